//! [`RedisClusterStore`]: objects on a Redis Cluster, over the crate's own RESP client
//! (`resp.rs`), every call within one deadline (`deadline.rs`).
//!
//! The `redis` crate's cluster client bounds each socket read, not a call, and retries on
//! its own schedule; this one is small enough to bound:
//!
//! - **Topology.** `CLUSTER SLOTS`, asked of the nodes it knows (then of the URL's), maps
//!   each of the 16384 slots to its master; it is read on first use and again after a
//!   `MOVED` or an error.
//! - **Routing.** A key's slot is the CRC16 (XMODEM) of the key, or of its hash tag (the
//!   part between the first `{` and the next `}`, when not empty), modulo 16384.
//! - **A batch** is split by node: one pipeline to each node, all written before any
//!   reply is read, so a batch costs one round trip.
//! - **Redirects.** A `MOVED` reply re-reads the topology (and takes the reply's node
//!   for that slot), an `ASK` sends `ASKING` and the command to the node it names, a
//!   `TRYAGAIN` tries again; the redirected commands go in another round, up to
//!   [`MAX_ROUNDS`] rounds, all within the call's deadline.
//!
//! After any error every connection and the topology are dropped: the next call starts
//! afresh, so a failed-over or restarted node is found again.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use parking_lot::Mutex;

use crate::deadline::Deadline;
use crate::redis_store::{self, OnReply, Pipelined, RedisUrl};
use crate::resp::{describe, one, Addr, Cmd, Conn, Head, Reply};
use crate::store::OpenError;
use crate::store::{get_via_each, Cause, Object, ObjectStore, Options, Parts, StoreError};

/// The number of hash slots.
pub const SLOTS: usize = 16384;

/// The most rounds of one call: the first, then redirected commands again.
pub const MAX_ROUNDS: usize = 5;

/// A slot no known node serves.
const NONE: u16 = u16::MAX;

/// CRC16/XMODEM (polynomial 0x1021, no reflection, initial value 0): Redis Cluster's key
/// hash.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 == 0 {
                crc << 1
            } else {
                (crc << 1) ^ 0x1021
            };
        }
    }
    crc
}

/// The hash slot of `key`.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    // 16384 is a power of two.
    crc16(tagged.unwrap_or(key)) & 0x3FFF
}

/// Where a redirect sends a command.
#[derive(Debug, PartialEq, Eq)]
enum Redirect {
    /// The slot lives on this node now.
    Moved(u16, Addr),
    /// Ask this node, once (the slot is migrating).
    Ask(Addr),
    /// Try again (a migration is under way).
    TryAgain,
}

/// The redirect an error reply asks for, if it is one; `from` is the node that answered
/// (a redirect without a host means its host). `Err`: a malformed redirect.
fn redirect(message: &str, from: &Addr) -> Result<Option<Redirect>, String> {
    let mut words = message.split(' ');
    let kind = words.next().unwrap_or_default();
    if kind == "TRYAGAIN" {
        return Ok(Some(Redirect::TryAgain));
    }
    if kind != "MOVED" && kind != "ASK" {
        return Ok(None);
    }
    let parsed = (|| {
        let slot = words
            .next()?
            .parse::<u16>()
            .ok()
            .filter(|&s| usize::from(s) < SLOTS)?;
        let (host, port) = words.next()?.rsplit_once(':')?;
        let port = port.parse::<u16>().ok().filter(|&p| p > 0)?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let host = if host.is_empty() {
            from.host.clone()
        } else {
            host.to_owned()
        };
        Some((slot, Addr { host, port }))
    })();
    match parsed {
        Some((slot, addr)) if kind == "MOVED" => Ok(Some(Redirect::Moved(slot, addr))),
        Some((_, addr)) => Ok(Some(Redirect::Ask(addr))),
        None => Err(format!("a malformed redirect {message:?}")),
    }
}

/// The position of `addr` in `masters`, where it is added if missing.
fn index_of(masters: &mut Vec<Addr>, addr: Addr) -> usize {
    if let Some(i) = masters.iter().position(|m| *m == addr) {
        i
    } else {
        masters.push(addr);
        masters.len() - 1
    }
}

/// The masters of a `CLUSTER SLOTS` reply and the slot map (slot → index into them);
/// `asked` is the node that answered (an empty host means its host). `Err`: what is
/// wrong with the reply.
fn parse_slots(reply: &Reply, asked: &Addr) -> Result<(Vec<u16>, Vec<Addr>), String> {
    let Reply::Array(ranges) = reply else {
        return Err(format!("CLUSTER SLOTS answered {}", describe(reply)));
    };
    let mut slots = vec![NONE; SLOTS];
    let mut masters: Vec<Addr> = Vec::new();
    for range in ranges {
        let bad = || format!("a malformed CLUSTER SLOTS entry: {}", describe(range));
        let Reply::Array(fields) = range else {
            return Err(bad());
        };
        let (Some(Reply::Int(start)), Some(Reply::Int(end)), Some(Reply::Array(node))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return Err(bad());
        };
        let (Some(Reply::Bulk(host)), Some(Reply::Int(port))) = (node.first(), node.get(1)) else {
            return Err(bad());
        };
        let (Ok(start), Ok(end), Ok(port)) = (
            usize::try_from(*start),
            usize::try_from(*end),
            u16::try_from(*port),
        ) else {
            return Err(bad());
        };
        if start > end || end >= SLOTS || port == 0 {
            return Err(bad());
        }
        let host = String::from_utf8_lossy(host).into_owned();
        // "?": the node does not know its address yet; its slots stay unserved.
        if host == "?" {
            continue;
        }
        let addr = Addr {
            host: if host.is_empty() {
                asked.host.clone()
            } else {
                host
            },
            port,
        };
        let index = index_of(&mut masters, addr);
        // At most one master a range, and at most 16384 ranges: fits.
        let index = u16::try_from(index).map_err(|_| bad())?;
        slots[start..=end].fill(index);
    }
    Ok((slots, masters))
}

/// What the store knows of the cluster, and its connections.
#[derive(Default)]
struct State {
    /// Slot → index into `masters`; empty while the topology is not known.
    slots: Vec<u16>,
    masters: Vec<Addr>,
    conns: HashMap<Addr, Conn>,
}

impl State {
    /// Forgets everything: the next call reads the topology and connects again.
    fn reset(&mut self) {
        *self = State::default();
    }

    /// The master of `slot`.
    fn node_of(&self, slot: u16) -> Option<&Addr> {
        let index = *self.slots.get(usize::from(slot))?;
        self.masters.get(usize::from(index))
    }

    /// `slot` lives on `addr` (from a `MOVED`).
    fn set(&mut self, slot: u16, addr: Addr) {
        let index = index_of(&mut self.masters, addr);
        if let (Ok(index), Some(s)) = (u16::try_from(index), self.slots.get_mut(usize::from(slot)))
        {
            *s = index;
        }
    }
}

/// Objects on a Redis Cluster
/// (`redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]`): keys spread over the
/// slots, each batch one pipeline per node (see the module docs).
pub struct RedisClusterStore {
    seeds: Vec<Addr>,
    auth: Vec<Vec<u8>>,
    options: Options,
    state: Mutex<State>,
}

impl fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seeds: Vec<String> = self.seeds.iter().map(ToString::to_string).collect();
        f.debug_struct("RedisClusterStore")
            .field("nodes", &seeds)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RedisClusterStore {
    /// A store on the cluster that the nodes of `url` belong to (any of its nodes: the
    /// others are found from them); connects on first use.
    pub fn new(url: &str, options: Options) -> Result<RedisClusterStore, OpenError> {
        let RedisUrl { nodes, auth, .. } = RedisUrl::parse(url, true)?;
        Ok(RedisClusterStore {
            seeds: nodes,
            auth,
            options,
            state: Mutex::new(State::default()),
        })
    }

    /// The connection to `addr`, made if there is none, armed with `deadline`.
    fn conn<'s>(
        &self,
        state: &'s mut State,
        op: &'static str,
        addr: &Addr,
        deadline: &Deadline,
    ) -> Result<&'s mut Conn, StoreError> {
        if !state.conns.contains_key(addr) {
            let con = Conn::connect(op, addr, &self.options, deadline, &self.auth, 0)?;
            state.conns.insert(addr.clone(), con);
        }
        let con = state.conns.get_mut(addr).ok_or_else(|| {
            StoreError::failed(op, Cause::Cluster, format!("no connection to {addr}"))
        })?;
        con.arm(deadline);
        Ok(con)
    }

    /// Reads the topology from the first node that answers: the masters known, then the
    /// URL's nodes.
    fn refresh(
        &self,
        state: &mut State,
        op: &'static str,
        deadline: &Deadline,
    ) -> Result<(), StoreError> {
        let mut candidates: Vec<Addr> = state.masters.clone();
        for s in &self.seeds {
            if !candidates.contains(s) {
                candidates.push(s.clone());
            }
        }
        let mut last = None;
        for addr in candidates {
            let asked = (|| {
                let con = self.conn(state, op, &addr, deadline)?;
                con.send(op, &[vec![one(b"CLUSTER"), one(b"SLOTS")]])?;
                match con.topology_reply(op)? {
                    Reply::Error(e) => Err(StoreError::failed(
                        op,
                        Cause::Cluster,
                        format!("{addr}: CLUSTER SLOTS refused: {e}"),
                    )),
                    reply => parse_slots(&reply, &addr).map_err(|what| con.protocol(op, &what)),
                }
            })();
            match asked {
                Ok((slots, masters)) => {
                    state.slots = slots;
                    state.masters = masters;
                    return Ok(());
                }
                Err(e) => {
                    state.conns.remove(&addr);
                    let timed_out = e.is_timeout();
                    last = Some(e);
                    if timed_out || deadline.remaining().is_none() {
                        break;
                    }
                }
            }
        }
        Err(last.unwrap_or_else(|| {
            StoreError::failed(op, Cause::Cluster, "no node to ask for the topology")
        }))
    }

    /// One call's rounds (see the module docs); the caller resets the state on error.
    fn rounds(
        &self,
        state: &mut State,
        op: &'static str,
        keys: &[&[u8]],
        cmds: &[Cmd<'_>],
        on: &mut OnReply<'_>,
        deadline: &Deadline,
    ) -> Result<(), StoreError> {
        if state.slots.is_empty() {
            self.refresh(state, op, deadline)?;
        }
        // Each command, and the node an ASK sent it to.
        let mut pending: Vec<(usize, Option<Addr>)> = (0..cmds.len()).map(|i| (i, None)).collect();
        for _ in 0..MAX_ROUNDS {
            let mut groups: BTreeMap<Addr, Vec<(usize, bool)>> = BTreeMap::new();
            for (i, ask) in pending {
                let (addr, asking) = if let Some(addr) = ask {
                    (addr, true)
                } else {
                    let slot = key_slot(keys[i]);
                    let addr = state.node_of(slot).ok_or_else(|| {
                        StoreError::failed(
                            op,
                            Cause::Cluster,
                            format!("slot {slot} (key {i}) is served by no node"),
                        )
                    })?;
                    (addr.clone(), false)
                };
                groups.entry(addr).or_default().push((i, asking));
            }
            // Every node's pipeline is written before any reply is read.
            for (addr, items) in &groups {
                let mut batch: Vec<Cmd<'_>> = Vec::with_capacity(items.len());
                for &(i, asking) in items {
                    if asking {
                        batch.push(vec![one(b"ASKING")]);
                    }
                    batch.push(cmds[i].clone());
                }
                self.conn(state, op, addr, deadline)?.send(op, &batch)?;
            }
            let mut next = Vec::new();
            let mut moved = Vec::new();
            for (addr, items) in &groups {
                let con = self.conn(state, op, addr, deadline)?;
                for &(i, asking) in items {
                    if asking {
                        match con.reply(op)? {
                            Reply::Ok => {}
                            Reply::Error(e) => return Err(con.server_error(op, &e)),
                            other => {
                                return Err(con.protocol(
                                    op,
                                    &format!("ASKING answered {}", describe(&other)),
                                ))
                            }
                        }
                    }
                    let head = con.head(op)?;
                    if let Head::Value(Reply::Error(e)) = &head {
                        match redirect(e, con.addr()).map_err(|what| con.protocol(op, &what))? {
                            Some(Redirect::Moved(slot, to)) => {
                                moved.push((slot, to));
                                next.push((i, None));
                                continue;
                            }
                            Some(Redirect::Ask(to)) => {
                                next.push((i, Some(to)));
                                continue;
                            }
                            Some(Redirect::TryAgain) => {
                                next.push((i, None));
                                continue;
                            }
                            None => {}
                        }
                    }
                    on(i, con, head)?;
                }
            }
            if next.is_empty() {
                return Ok(());
            }
            if !moved.is_empty() {
                self.refresh(state, op, deadline)?;
                for (slot, to) in moved {
                    state.set(slot, to);
                }
            }
            pending = next;
        }
        Err(StoreError::failed(
            op,
            Cause::Cluster,
            format!("keys still redirected after {MAX_ROUNDS} rounds"),
        ))
    }

    /// Reads the topology, checks that every slot is served, and pings every master.
    fn check_all(&self, state: &mut State, deadline: &Deadline) -> Result<(), StoreError> {
        let op = "check";
        self.refresh(state, op, deadline)?;
        let unserved = state.slots.iter().filter(|&&s| s == NONE).count();
        if let Some(first) = state.slots.iter().position(|&s| s == NONE) {
            return Err(StoreError::failed(
                op,
                Cause::Cluster,
                format!("{unserved} of {SLOTS} slots are served by no node (the first: {first})"),
            ));
        }
        for addr in state.masters.clone() {
            let con = self.conn(state, op, &addr, deadline)?;
            con.send(op, &[vec![one(b"PING")]])?;
            match con.reply(op)? {
                Reply::Status(s) if s == "PONG" => {}
                Reply::Error(e) => return Err(con.server_error(op, &e)),
                other => {
                    return Err(con.protocol(op, &format!("PING answered {}", describe(&other))))
                }
            }
        }
        Ok(())
    }
}

impl Pipelined for RedisClusterStore {
    fn run(
        &self,
        op: &'static str,
        keys: &[&[u8]],
        cmds: &[Cmd<'_>],
        on: &mut OnReply<'_>,
    ) -> Result<(), StoreError> {
        if cmds.is_empty() {
            return Ok(());
        }
        let deadline = Deadline::start(&self.options);
        let mut state = self.state.lock();
        let result = self.rounds(&mut state, op, keys, cmds, on, &deadline);
        if result.is_err() {
            state.reset();
        }
        result
    }
}

impl ObjectStore for RedisClusterStore {
    fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        redis_store::exists(self, keys)
    }

    fn put(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        let parts: Vec<Parts<'_>> = values.iter().map(|v| one(v)).collect();
        redis_store::put(self, keys, &parts)
    }

    fn put_parts(&self, keys: &[&[u8]], values: &[Parts<'_>]) -> Result<Vec<bool>, StoreError> {
        redis_store::put(self, keys, values)
    }

    fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        get_via_each(self, keys, Cause::Server)
    }

    fn get_each(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Object<'_>),
    ) -> Result<(), StoreError> {
        redis_store::get_each(self, keys, visit)
    }

    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError> {
        redis_store::delete(self, keys)
    }

    fn check(&self) -> Result<(), StoreError> {
        let deadline = Deadline::start(&self.options);
        let mut state = self.state.lock();
        let result = self.check_all(&mut state, &deadline);
        if result.is_err() {
            state.reset();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(host: &str, port: u16) -> Addr {
        Addr {
            host: host.to_owned(),
            port,
        }
    }

    #[test]
    fn slots_are_redis_clusters() {
        // The reference value of CRC16/XMODEM, and slots `redis-cli cluster keyslot` gives.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b""), 0);
        // Hash tags: the first {...} with something inside.
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") & 16383);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"{unclosed"), crc16(b"{unclosed") & 16383);
    }

    #[test]
    fn redirects_are_parsed() {
        let from = addr("10.0.0.1", 7000);
        assert_eq!(
            redirect("MOVED 3999 127.0.0.1:6381", &from),
            Ok(Some(Redirect::Moved(3999, addr("127.0.0.1", 6381))))
        );
        assert_eq!(
            redirect("ASK 1 :6382", &from),
            Ok(Some(Redirect::Ask(addr("10.0.0.1", 6382))))
        );
        assert_eq!(
            redirect("MOVED 2 [::1]:7", &from),
            Ok(Some(Redirect::Moved(2, addr("::1", 7))))
        );
        assert_eq!(
            redirect("TRYAGAIN later", &from),
            Ok(Some(Redirect::TryAgain))
        );
        assert_eq!(redirect("ERR no", &from), Ok(None));
        for bad in [
            "MOVED",
            "MOVED 16384 h:1",
            "MOVED 1 h",
            "ASK 1 h:0",
            "MOVED x h:1",
        ] {
            assert!(
                redirect(bad, &from).unwrap_err().contains("malformed"),
                "{bad}"
            );
        }
    }

    fn entry(start: i64, end: i64, host: &str, port: i64) -> Reply {
        Reply::Array(vec![
            Reply::Int(start),
            Reply::Int(end),
            Reply::Array(vec![
                Reply::Bulk(host.as_bytes().to_vec()),
                Reply::Int(port),
                Reply::Bulk(b"id".to_vec()),
            ]),
        ])
    }

    #[test]
    fn the_topology_maps_every_slot_to_its_master() {
        let asked = addr("10.0.0.9", 1);
        let reply = Reply::Array(vec![
            entry(0, 99, "a", 1),
            entry(100, 16383, "", 2),
            entry(50, 60, "a", 1),
        ]);
        let (slots, masters) = parse_slots(&reply, &asked).unwrap();
        assert_eq!(masters, [addr("a", 1), addr("10.0.0.9", 2)]);
        assert_eq!(
            (slots[0], slots[99], slots[100], slots[16383]),
            (0, 0, 1, 1)
        );
        // Unknown addresses and missing ranges leave slots unserved.
        let (slots, _) = parse_slots(&Reply::Array(vec![entry(0, 9, "?", 1)]), &asked).unwrap();
        assert!(slots.iter().all(|&s| s == NONE));
        for bad in [
            Reply::Int(1),
            Reply::Array(vec![Reply::Int(1)]),
            Reply::Array(vec![entry(5, 4, "a", 1)]),
            Reply::Array(vec![entry(0, 16384, "a", 1)]),
            Reply::Array(vec![entry(-1, 4, "a", 1)]),
            Reply::Array(vec![entry(0, 4, "a", 0)]),
            Reply::Array(vec![entry(0, 4, "a", 70000)]),
        ] {
            assert!(parse_slots(&bad, &asked).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_moved_slot_goes_to_its_new_node() {
        let mut state = State {
            slots: vec![0; SLOTS],
            masters: vec![addr("a", 1)],
            conns: HashMap::new(),
        };
        state.set(7, addr("b", 2));
        state.set(8, addr("a", 1));
        assert_eq!(state.node_of(7), Some(&addr("b", 2)));
        assert_eq!(state.node_of(8), Some(&addr("a", 1)));
        assert_eq!(state.masters.len(), 2);
        state.reset();
        assert_eq!(state.node_of(7), None);
    }
}
