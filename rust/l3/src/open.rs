//! [`open()`]: a store from its URL.
//!
//! | URL                                                             | store                    |
//! |-----------------------------------------------------------------|--------------------------|
//! | `redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`                      | [`RedisStore`]           |
//! | `redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]`    | [`RedisClusterStore`]: the nodes to discover the cluster from (any subset) |
//! | `file:///ABSOLUTE/DIR`                                          | [`FileStore`]            |
//!
//! The user and password are percent-encoded (`%40` for `@`); `HOST` may be an IPv6
//! address in brackets.

use std::path::Path;

use crate::cluster::RedisClusterStore;
use crate::file::FileStore;
use crate::redis_store::RedisStore;
use crate::store::{ObjectStore, OpenError, Options};

fn bad(url: &str, reason: impl Into<String>) -> OpenError {
    OpenError::Url {
        url: url.to_owned(),
        reason: reason.into(),
    }
}

/// Opens the store that `url` names (see the module docs). Redis stores connect on
/// first use, so a store that is down opens fine and fails its calls: call
/// [`ObjectStore::check`] to know at once.
pub fn open(url: &str, options: Options) -> Result<Box<dyn ObjectStore>, OpenError> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(bad(
            url,
            "no scheme (expected redis://, redis+cluster:// or file://)",
        ));
    };
    match scheme {
        "redis" => Ok(Box::new(RedisStore::new(url, options)?)),
        "redis+cluster" => Ok(Box::new(RedisClusterStore::new(url, options)?)),
        "file" => {
            if !Path::new(rest).is_absolute() {
                return Err(bad(
                    url,
                    format!("path {rest:?} is not absolute (file:///ABSOLUTE/DIR)"),
                ));
            }
            Ok(Box::new(FileStore::with_options(rest, options)?))
        }
        other => Err(bad(
            url,
            format!("scheme {other:?} is not redis, redis+cluster or file"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Cause;
    use crate::store::StoreError;

    fn reason(url: &str) -> String {
        match open(url, Options::default()).unwrap_err() {
            OpenError::Url { url: u, reason } => {
                assert_eq!(u, url);
                reason
            }
            other @ OpenError::Store(_) => panic!("{other}"),
        }
    }

    #[test]
    fn bad_urls_name_the_bad_part() {
        assert!(reason("localhost:6379").contains("no scheme"));
        assert!(reason("mooncake://h:1").contains("scheme \"mooncake\""));
        assert!(reason("redis://localhost").contains("\"localhost\" is not HOST:PORT"));
        assert!(reason("redis://:6379").contains("no host"));
        assert!(reason("redis://h:notaport").contains("port \"notaport\""));
        assert!(reason("redis://h:0").contains("port \"0\""));
        assert!(reason("redis://h:70000").contains("port \"70000\""));
        assert!(reason("redis+cluster://a:1,b").contains("\"b\" is not HOST:PORT"));
        assert!(reason("redis+cluster://a:1,b:2/0").contains("no database"));
        assert!(reason("file://relative/dir").contains("not absolute"));
        let db = reason("redis://h:1/notadb");
        assert!(db.to_lowercase().contains("database"), "{db}");
    }

    #[test]
    fn good_urls_open_without_connecting() {
        // Port 1 on loopback: nothing listens, and nothing is tried until a call.
        open("redis://127.0.0.1:1", Options::default()).unwrap();
        open("redis://127.0.0.1:1/3", Options::default()).unwrap();
        open(
            "redis+cluster://127.0.0.1:1,127.0.0.1:2",
            Options::default(),
        )
        .unwrap();
    }

    #[test]
    fn file_url_creates_the_directory() {
        let dir = std::env::temp_dir().join(format!("rcl3-open-{}", std::process::id()));
        let url = format!("file://{}", dir.join("a/b").display());
        open(&url, Options::default()).unwrap();
        assert!(dir.join("a/b").is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unusable_file_directory_is_a_store_error() {
        // A directory under a regular file cannot be created.
        let file = std::env::temp_dir().join(format!("rcl3-open-file-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let url = format!("file://{}/sub", file.display());
        let e = open(&url, Options::default()).unwrap_err();
        assert!(
            matches!(
                e,
                OpenError::Store(StoreError::Failed {
                    op: "open",
                    cause: Cause::Io,
                    ..
                })
            ),
            "{e}"
        );
        std::fs::remove_file(&file).unwrap();
    }
}
