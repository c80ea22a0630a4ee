//! Writes the daemon's log to stderr at RUST_LOG's level (default info), as text or, with
//! `--log-format json`, one JSON object per line carrying each line's key-values as
//! fields (the per-file lines of `shared::log_line`).

use std::io::Write;

use log::kv::{self, VisitSource};

use crate::shared::log_line;

/// Starts logging; the format follows `log_line::set` from then on (SIGHUP switches it).
pub fn init() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| {
            if log_line::json() {
                let mut line = serde_json::Map::new();
                line.insert("time".into(), buf.timestamp_micros().to_string().into());
                line.insert("level".into(), record.level().as_str().into());
                line.insert("message".into(), record.args().to_string().into());
                let _ = record.key_values().visit(&mut Fields(&mut line));
                writeln!(buf, "{}", serde_json::Value::Object(line))
            } else {
                writeln!(
                    buf,
                    "[{} {:<5}] {}",
                    buf.timestamp_millis(),
                    record.level(),
                    record.args()
                )
            }
        })
        .init();
}

struct Fields<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl<'kvs> VisitSource<'kvs> for Fields<'_> {
    fn visit_pair(&mut self, key: kv::Key<'kvs>, value: kv::Value<'kvs>) -> Result<(), kv::Error> {
        let value = match value.to_u64() {
            Some(n) => n.into(),
            None => value.to_string().into(),
        };
        self.0.insert(key.as_str().to_owned(), value);
        Ok(())
    }
}
