//! Face **report**: what people and Prometheus read. The metrics page (`metrics`), the
//! log's format (`logs`), and the tables of `status` and `profile show` (`show`).
//!
//! May use: `redirect`, `cache`, `place`, `observe`, `profile`, `shared`.

pub mod logs;
pub mod metrics;
pub mod show;
