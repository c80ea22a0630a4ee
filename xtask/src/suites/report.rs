//! What a whole run says at its end: when each phase began and ended (phases run side
//! by side), every test's time (libtest's `--report-time`, on the host and in the
//! guests), the ten slowest, and what failed. Each test binary's output goes through
//! `Report::line`, which also prints it, prefixed with where it ran.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// How many of the slowest tests the summary lists.
pub const SLOWEST: usize = 10;

pub struct Report {
    started: Instant,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    phases: Vec<Phase>,
    tests: Vec<TestTime>,
    failures: Vec<String>,
}

struct Phase {
    name: String,
    from: Duration,
    to: Duration,
    ok: bool,
}

/// One test's time, and where it ran: `host` or a guest (`6.1/nfs3`).
#[derive(Clone, Debug, PartialEq)]
pub struct TestTime {
    pub place: String,
    /// `suite::test::path`.
    pub name: String,
    pub secs: f64,
    pub ok: bool,
}

impl Default for Report {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            inner: Mutex::default(),
        }
    }
}

impl Report {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Runs `work` as the phase `name`: printed as it begins and ends, timed, and a
    /// failure kept for the summary (and returned).
    pub fn phase<T>(&self, name: &str, work: impl FnOnce() -> Result<T>) -> Result<T> {
        let from = self.elapsed();
        println!("== {name}: begins at {} s", from.as_secs());
        let result = work();
        let to = self.elapsed();
        println!(
            "== {name}: {} at {} s (took {} s){}",
            if result.is_ok() { "done" } else { "FAILED" },
            to.as_secs(),
            (to - from).as_secs(),
            result
                .as_ref()
                .err()
                .map_or(String::new(), |e| format!(": {e:#}"))
        );
        let mut inner = self.inner();
        inner.phases.push(Phase {
            name: name.to_owned(),
            from,
            to,
            ok: result.is_ok(),
        });
        if let Err(e) = &result {
            inner.failures.push(format!("{name}: {e:#}"));
        }
        result
    }

    /// A line a test binary printed at `place`, in `suite`: printed, and its time kept
    /// if it is a test's result.
    pub fn line(&self, place: &str, suite: &str, line: &str) {
        if place == "host" {
            println!("{line}");
        } else {
            println!("{place}│ {line}");
        }
        if let Some((name, ok, secs)) = test_result(line) {
            self.inner().tests.push(TestTime {
                place: place.to_owned(),
                name: format!("{suite}::{name}"),
                secs,
                ok,
            });
        }
    }

    /// Runs a test binary (`cmd`, given `--report-time` by the caller) with its output
    /// read line by line into the report; fails if it does. Done when the binary exits:
    /// a process it left behind (a test that failed before its cleanup) may hold its
    /// output open, and is not waited for beyond a moment.
    pub fn run_tests(&self, place: &str, suite: &str, cmd: &mut Command) -> Result<()> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        let out = child.stdout.take().context("no stdout")?;
        let (lines_tx, lines) = std::sync::mpsc::channel();
        // Its own thread, not waited for: it ends when the last writer closes.
        std::thread::spawn(move || {
            let mut out = BufReader::new(out);
            let mut buf = Vec::new();
            while out.read_until(b'\n', &mut buf).unwrap_or(0) > 0 {
                let line = String::from_utf8_lossy(&buf)
                    .trim_end_matches('\n')
                    .to_owned();
                if lines_tx.send(line).is_err() {
                    return;
                }
                buf.clear();
            }
        });
        let mut exited: Option<(std::process::ExitStatus, Instant)> = None;
        loop {
            match lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => self.line(place, suite, &line),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if exited.is_none() {
                exited = child.try_wait()?.map(|s| (s, Instant::now()));
            }
            if exited.is_some_and(|(_, at)| at.elapsed() > Duration::from_secs(5)) {
                println!(
                    "({suite} on {place}: a process it left holds its output; not waited for)"
                );
                break;
            }
        }
        let status = match exited {
            Some((status, _)) => status,
            None => child.wait()?,
        };
        if !status.success() {
            bail!("{suite} on {place} failed ({status})");
        }
        Ok(())
    }

    /// The slowest tests, slowest first.
    pub fn slowest(&self, n: usize) -> Vec<TestTime> {
        let mut tests = self.inner().tests.clone();
        tests.sort_by(|a, b| b.secs.total_cmp(&a.secs));
        tests.truncate(n);
        tests
    }

    /// The end of a run: its phases, its slowest tests, and what failed.
    pub fn summary(&self) -> String {
        let inner = self.inner();
        let mut s = format!(
            "\n== the whole run: {} s; its phases (side by side where they overlap):\n",
            self.elapsed().as_secs()
        );
        for p in &inner.phases {
            s += &format!(
                "  {:>5} s .. {:>5} s  {:>5} s  {}{}\n",
                p.from.as_secs(),
                p.to.as_secs(),
                (p.to - p.from).as_secs(),
                p.name,
                if p.ok { "" } else { "  FAILED" }
            );
        }
        let total: f64 = inner.tests.iter().map(|t| t.secs).sum();
        s += &format!(
            "== {} tests took {:.0} s in all; the {SLOWEST} slowest:\n",
            inner.tests.len(),
            total
        );
        drop(inner);
        for t in self.slowest(SLOWEST) {
            s += &format!(
                "  {:>7.1} s  {:<10} {}{}\n",
                t.secs,
                t.place,
                t.name,
                if t.ok { "" } else { "  FAILED" }
            );
        }
        let inner = self.inner();
        if !inner.failures.is_empty() {
            s += "== failed:\n";
            for f in &inner.failures {
                s += &format!("  {f}\n");
            }
        }
        s
    }

    pub fn failed(&self) -> bool {
        !self.inner().failures.is_empty()
    }
}

/// A libtest result line with its time: `test a::b ... ok <1.234s>`.
fn test_result(line: &str) -> Option<(&str, bool, f64)> {
    let rest = line.strip_prefix("test ")?;
    let (name, outcome) = rest.split_once(" ... ")?;
    let (word, time) = outcome.split_once(" <")?;
    let ok = match word {
        "ok" => true,
        "FAILED" => false,
        _ => return None,
    };
    let secs = time.strip_suffix("s>")?.parse().ok()?;
    Some((name, ok, secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_lines_with_times_are_kept_and_others_are_not() {
        let r = Report::default();
        r.line("host", "smoke", "test a::quick ... ok <0.250s>");
        r.line("6.1/nfs3", "rest", "test slow_one ... FAILED <93.500s>");
        r.line("host", "smoke", "test no_time ... ok");
        r.line("host", "smoke", "test ignored_one ... ignored");
        r.line("host", "smoke", "test result: ok. 2 passed; 0 failed");
        let slowest = r.slowest(SLOWEST);
        assert_eq!(
            slowest,
            vec![
                TestTime {
                    place: "6.1/nfs3".into(),
                    name: "rest::slow_one".into(),
                    secs: 93.5,
                    ok: false
                },
                TestTime {
                    place: "host".into(),
                    name: "smoke::a::quick".into(),
                    secs: 0.25,
                    ok: true
                },
            ]
        );
        assert!(r.summary().contains("rest::slow_one  FAILED"));
    }

    #[test]
    fn a_failed_phase_is_kept_for_the_summary() {
        let r = Report::default();
        r.phase("fine", || Ok(())).unwrap();
        assert!(!r.failed());
        assert!(r.phase("broken", || -> Result<()> { bail!("no") }).is_err());
        assert!(r.failed());
        assert!(r.summary().contains("broken: no"));
    }
}
