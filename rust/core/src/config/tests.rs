//! Unit tests of the configuration: policy names parse and print back, and every
//! argument [`Config::validate`](super::Config::validate) refuses is named in its error.

use super::*;

#[test]
fn parses_and_names_policies() {
    for p in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective,
        WritePolicy::WriteBack,
    ] {
        assert_eq!(p.as_str().parse::<WritePolicy>(), Ok(p));
    }
    let err = "lru".parse::<WritePolicy>().unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidArgument {
            arg: "write_policy",
            ..
        }
    ));
}

#[test]
fn a_hash_seed_without_page_hashes_is_refused_naming_hash_seed() {
    let c = Config {
        hash_seed: Some([1; 32]),
        ..Config::kv(16, 1)
    };
    assert!(matches!(
        c.validate(),
        Err(Error::InvalidArgument {
            arg: "hash_seed",
            ..
        })
    ));
    let c = Config {
        page_hashes: true,
        ..c
    };
    assert_eq!(c.validate(), Ok(()));
}

#[test]
fn events_without_page_hashes_are_refused_naming_events() {
    let c = Config {
        events: true,
        ..Config::kv(16, 1)
    };
    assert!(matches!(
        c.validate(),
        Err(Error::InvalidArgument { arg: "events", .. })
    ));
    let c = Config {
        page_hashes: true,
        ..c
    };
    assert_eq!(c.validate(), Ok(()));
}

#[test]
fn validation_names_the_argument() {
    let arg_of = |c: Config| match c.validate() {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected an argument error, got {other:?}"),
    };
    assert_eq!(arg_of(Config::kv(10, 4)), "kv_slots");
    assert_eq!(arg_of(Config::kv(8, 0)), "page_size");
    assert_eq!(arg_of(Config::kv(0, 1)), "kv_slots");
    assert_eq!(
        arg_of(Config {
            write_through_threshold: Some(0),
            write_policy: WritePolicy::WriteThroughSelective,
            host_kv_slots: 8,
            ..Config::kv(8, 1)
        }),
        "write_through_threshold"
    );
    // A threshold the policy would ignore, and a policy with nothing to back up to.
    assert_eq!(
        arg_of(Config {
            write_through_threshold: Some(3),
            host_kv_slots: 8,
            ..Config::kv(8, 1)
        }),
        "write_through_threshold"
    );
    for p in [WritePolicy::WriteBack, WritePolicy::WriteThroughSelective] {
        assert_eq!(
            arg_of(Config {
                write_policy: p,
                ..Config::kv(8, 1)
            }),
            "write_policy"
        );
    }
    assert_eq!(
        arg_of(Config {
            host_kv_slots: 6,
            ..Config::kv(8, 4)
        }),
        "host_kv_slots"
    );
    assert_eq!(
        arg_of(Config {
            host_kv_slots: 8,
            host_mamba_slots: 2,
            ..Config::kv(8, 1)
        }),
        "host_mamba_slots"
    );
    assert_eq!(
        arg_of(Config {
            mamba_slots: 2,
            host_mamba_slots: 2,
            ..Config::kv(8, 1)
        }),
        "host_mamba_slots"
    );
    assert!(Config {
        mamba_slots: 2,
        host_kv_slots: 16,
        host_mamba_slots: 2,
        ..Config::kv(8, 1)
    }
    .validate()
    .is_ok());
    assert!(Config {
        mamba_slots: 4,
        ..Config::kv(8, 1)
    }
    .validate()
    .is_ok());
    assert!(Config::kv(64, 4).validate().is_ok());
}

#[test]
fn engine_owned_pools_refuse_a_host_tier_naming_the_argument() {
    let engine = |c: Config| Config {
        pools: PoolOwner::Engine,
        ..c
    };
    for (config, arg) in [
        (
            engine(Config {
                host_kv_slots: 8,
                ..Config::kv(8, 1)
            }),
            "host_kv_slots",
        ),
        (
            engine(Config {
                mamba_slots: 2,
                host_kv_slots: 8,
                host_mamba_slots: 2,
                ..Config::kv(8, 1)
            }),
            "host_kv_slots",
        ),
    ] {
        let err = config.validate().unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { arg: a, reason } if *a == arg
                && reason.contains("pools=\"engine\"")),
            "{err}"
        );
    }
    // Without a host KV tier a host state tier is refused as before, naming it.
    let err = engine(Config {
        mamba_slots: 2,
        host_mamba_slots: 2,
        ..Config::kv(8, 1)
    })
    .validate()
    .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { arg: "host_mamba_slots", reason }
            if reason.contains("pools=\"engine\"")),
        "{err}"
    );
    assert!(engine(Config {
        mamba_slots: 4,
        ..Config::kv(8, 2)
    })
    .validate()
    .is_ok());
}

#[test]
fn parses_and_names_eviction_policies() {
    for p in EvictionPolicy::ALL {
        assert_eq!(p.as_str().parse::<EvictionPolicy>(), Ok(p));
        assert_eq!(p.to_string(), p.as_str());
    }
    assert_eq!(
        "state_value".parse::<EvictionPolicy>(),
        Ok(EvictionPolicy::StateValue)
    );
    let err = "mru".parse::<EvictionPolicy>().unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { arg: "eviction_policy", reason }
            if reason.contains("\"lfu\"") && reason.contains("\"state-value\"")),
        "{err}"
    );
}

#[test]
fn state_value_is_for_states_only() {
    let both = "state-value".parse::<EvictionPolicies>().unwrap();
    assert_eq!(both.kv, EvictionPolicy::Lru);
    assert_eq!(both.mamba, EvictionPolicy::StateValue);
    assert_eq!(both.swa, EvictionPolicy::Lru, "a plain name skips SWA too");
    assert_eq!(
        "lfu".parse::<EvictionPolicies>(),
        Ok(EvictionPolicies {
            kv: EvictionPolicy::Lfu,
            mamba: EvictionPolicy::Lfu,
            swa: EvictionPolicy::Lfu,
        })
    );
    let only_mamba = EvictionPolicies::from_components([("mamba", "priority")]).unwrap();
    assert_eq!(
        only_mamba.kv,
        EvictionPolicy::Lru,
        "a missing component keeps lru"
    );
    assert_eq!(only_mamba.mamba, EvictionPolicy::Priority);
    assert_eq!(only_mamba.swa, EvictionPolicy::Lru);
    let only_swa = EvictionPolicies::from_components([("swa", "lfu")]).unwrap();
    assert_eq!(
        (only_swa.kv, only_swa.mamba, only_swa.swa),
        (
            EvictionPolicy::Lru,
            EvictionPolicy::Lru,
            EvictionPolicy::Lfu
        )
    );
    for (bad, says) in [
        (vec![("kv", "state-value")], "for \"kv\""),
        (vec![("swa", "state-value")], "for \"swa\""),
        (vec![("full", "lru")], "\"swa\""),
        (vec![("kv", "fifo")], "\"priority\""),
    ] {
        let err = EvictionPolicies::from_components(bad).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::InvalidArgument {
                    arg: "eviction_policy",
                    reason,
                } if reason.contains(says)
            ),
            "{err}"
        );
    }
    for eviction_policy in [
        EvictionPolicies {
            kv: EvictionPolicy::StateValue,
            ..EvictionPolicies::default()
        },
        EvictionPolicies {
            swa: EvictionPolicy::StateValue,
            ..EvictionPolicies::default()
        },
    ] {
        let err = Config {
            eviction_policy,
            ..Config::kv(8, 1)
        }
        .validate()
        .unwrap_err();
        assert!(matches!(
            err,
            Error::InvalidArgument {
                arg: "eviction_policy",
                ..
            }
        ));
    }
}

#[test]
fn parses_and_names_pool_owners() {
    for o in [PoolOwner::Cache, PoolOwner::Engine] {
        assert_eq!(o.as_str().parse::<PoolOwner>(), Ok(o));
        assert_eq!(o.to_string(), o.as_str());
    }
    let err = "sglang".parse::<PoolOwner>().unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { arg: "pools", reason } if reason.contains("\"engine\"")),
        "{err}"
    );
}
