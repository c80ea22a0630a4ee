//! Observability and operation: Prometheus metrics (checked by promtool and scraped by a
//! real Prometheus server), hit/miss/write logs, `status`, the config file with
//! `--check-config` and SIGHUP, an orderly SIGTERM, and the files in contrib/.

use std::{
    collections::BTreeSet,
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use hocus_tests::{
    Agent, NetworkMount, agent_bin, assert_success, names_in, read_all, sample_names, wait_until,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// Opens each file named after the count that many times, reading it whole; names that
/// do not exist are probed (a failed lookup).
const OPEN_EACH: &str = "import sys
n = int(sys.argv[1])
for p in sys.argv[2:]:
    for _ in range(n):
        try:
            open(p, 'rb').read()
        except FileNotFoundError:
            pass";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The watched root as the daemon labels it.
fn root(agent: &Agent) -> String {
    agent.status()["watched"][0]["path"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Runs `python3 -c OPEN_EACH n files...` as a `hocus-agent run` job.
fn job_opens(agent: &Agent, n: u32, files: &[&Path]) {
    let n = n.to_string();
    let mut args = vec!["run", "--", "python3", "-c", OPEN_EACH, n.as_str()];
    args.extend(files.iter().map(|f| f.to_str().unwrap()));
    assert_success(&agent.cli(&args).output().unwrap());
}

/// A real Prometheus server (Debian's package) scraping one target every second.
struct Prometheus {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: hocus\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr = {
            let probe = TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().to_string()
        };
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.path().join("prometheus.log")).unwrap())
            .spawn()
            .expect("starting prometheus (cargo xtask setup installs it)");
        let prometheus = Self {
            child,
            addr,
            _dir: dir,
        };
        wait_until(60, "Prometheus to be ready", || {
            hocus_tests::try_http_get(&prometheus.addr, "/-/ready").is_some()
        });
        prometheus
    }

    /// The value of an instant query's first result.
    fn query(&self, promql: &str) -> Option<f64> {
        let encoded: String = promql
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let body =
            hocus_tests::try_http_get(&self.addr, &format!("/api/v1/query?query={encoded}"))?;
        let v: Value = serde_json::from_str(&body).ok()?;
        v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    }

    fn log(&self) -> String {
        fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn metrics_pass_promtool_and_prometheus_scrapes_the_hits_of_a_known_workload() {
    let net = NetworkMount::start();
    let files: Vec<PathBuf> = (0..4)
        .map(|i| net.put(&format!("lib/m{i}.py"), format!("x = {i}\n").as_bytes()))
        .collect();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    for f in &files {
        read_all(f); // 4 opens from the network, outside any job
    }
    wait_until(60, "the files to be cached", || {
        agent.settled()["cached_files"] == 4
    });
    let cache = agent.settled();
    let lib = net.path("lib");
    assert!(
        cache["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| Path::new(s.as_str().unwrap()) == lib),
        "lib/ is held as a snapshot: {cache:#}"
    );
    // The job: 3 opens of each file, and a probe of a name lib/ does not hold.
    let mut names: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let absent = net.path("lib/absent.py");
    names.push(&absent);
    job_opens(&agent, 3, &names);

    let root = root(&agent);
    let sample = |name: &str, label: &str, value: &str| {
        agent.metric(&format!("{name}{{root=\"{root}\",{label}=\"{value}\"}}"))
    };
    wait_until(30, "the job's opens in the metrics", || {
        sample("hocus_opens_total", "served", "local") == 12
    });
    assert_eq!(sample("hocus_opens_total", "served", "network"), 4);
    assert_eq!(sample("hocus_failed_lookups_total", "answered", "local"), 3);
    assert_eq!(
        agent.metric(&format!("hocus_job_opens_total{{root=\"{root}\"}}")),
        12
    );
    assert_eq!(agent.metric("hocus_jobs_started_total"), 1);
    assert_eq!(agent.metric("hocus_copies_total"), 4);
    assert_eq!(
        agent.metric(&format!("hocus_working_set_files{{root=\"{root}\"}}")),
        4
    );

    // promtool accepts the page as served to it.
    let page = agent.metrics();
    let file = agent.dir.path().join("metrics.txt");
    fs::write(&file, &page).unwrap();
    let out = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(fs::File::open(&file).unwrap())
        .output()
        .expect("running promtool (cargo xtask setup installs it)");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{page}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // A real Prometheus server scrapes it (it asks for OpenMetrics) and answers queries.
    let prometheus = Prometheus::start(&agent.metrics_addr());
    let mut last = None;
    wait_until(60, "Prometheus to have scraped the hits", || {
        last = prometheus.query("sum by (served) (hocus_opens_total{served=\"local\"})");
        last == Some(12.0)
    });
    assert_eq!(
        prometheus.query("sum(hocus_opens_total)"),
        Some(16.0),
        "{}",
        prometheus.log()
    );
    assert_eq!(prometheus.query("hocus_build_info"), Some(1.0));

    // status tells the same story, with the hottest files and where they are held.
    let out = agent.cli(&["status"]).output().unwrap();
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("hits: 12 of 16 opens served by local copies (75.0%)"),
        "{text}"
    );
    assert!(
        text.contains("failed lookups answered locally: 3 of 3"),
        "{text}"
    );
    assert!(text.contains("lost: none"), "{text}");
    let hottest = text
        .split("Hottest files")
        .nth(1)
        .expect("a table of hot files");
    for f in &files {
        assert!(hottest.contains(f.to_str().unwrap()), "{text}");
    }
    let json: Value =
        serde_json::from_slice(&agent.cli(&["status", "--json"]).output().unwrap().stdout).unwrap();
    assert_eq!(json["top"][0]["opens"], 4, "{json:#}");
    assert_eq!(json["top"][0]["held"], "ram", "{json:#}");
}

#[test]
fn status_without_a_daemon_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(agent_bin())
        .arg("--socket")
        .arg(dir.path().join("none.sock"))
        .args(["status"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no hocus-agent daemon is running") && err.contains("hocus-agent --watch"),
        "{err}"
    );
}

/// The JSON log lines of a daemon started with `--log-format json`. Only whole lines:
/// the log is read while the daemon writes, so the last one may be half written.
fn json_lines(log: &str) -> Vec<Value> {
    let whole = log.rfind('\n').map_or("", |end| &log[..end]);
    whole
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

#[test]
fn hit_miss_and_write_logs_name_the_file_the_process_and_the_reason() {
    let net = NetworkMount::start();
    let hot = net.put("a/hot.py", b"hot = 1\n");
    let cold = net.put("b/cold.py", b"cold = 1\n");
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--log-hits",
        "--log-misses",
        "--log-format",
        "json",
    ]);
    read_all(&hot);
    wait_until(60, "hot.py to be cached", || {
        agent.settled()["cached_files"] == 1
    });
    job_opens(&agent, 1, &[&hot, &cold]);
    let written = net.path("b/out.txt");
    let out = agent
        .cli(&[
            "run",
            "--",
            "sh",
            "-c",
            &format!("echo x > {}", written.display()),
        ])
        .output()
        .unwrap();
    assert_success(&out);

    let find = |event: &str, file: &Path| {
        json_lines(&agent.log())
            .into_iter()
            .find(|l| l["event"] == event && l["file"] == file.to_str().unwrap())
    };
    wait_until(30, "the hit, miss and write lines", || {
        find("hit", &hot).is_some()
            && find("miss", &cold).is_some()
            && find("write", &written).is_some()
    });
    let hit = find("hit", &hot).unwrap();
    assert_eq!(hit["process"], "python3", "{hit}");
    assert!(hit["pid"].as_u64().unwrap() > 0, "{hit}");
    assert!(
        hit["reason"].as_str().unwrap().contains("local copy")
            || hit["reason"].as_str().unwrap().contains("snapshot"),
        "{hit}"
    );
    assert!(
        hit["message"].as_str().unwrap().starts_with("hit: "),
        "{hit}"
    );
    let miss = find("miss", &cold).unwrap();
    assert_eq!(miss["process"], "python3", "{miss}");
    assert_eq!(
        miss["reason"], "first seen: not in the working set yet",
        "{miss}"
    );
    let write = find("write", &written).unwrap();
    assert_eq!(write["process"], "sh", "{write}");
    assert_eq!(write["reason"], "created or truncated", "{write}");
    let copy = find("cache write", &hot).expect("the copy of hot.py is logged");
    assert!(
        copy["reason"].as_str().unwrap().contains("copied to"),
        "{copy}"
    );
    // The write went to the network, not to a copy.
    assert_eq!(
        fs::read_to_string(net.server_path("b/out.txt")).unwrap(),
        "x\n"
    );
}

#[test]
fn the_config_file_is_overridden_by_flags_checked_and_reloaded_on_sighup() {
    let net = NetworkMount::start();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("agent.toml");
    fs::write(
        &config,
        "ram-budget = \"1M\"\nssd-budget = \"8M\"\nlog-hits = false\n",
    )
    .unwrap();
    let config_arg = config.to_str().unwrap();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--config",
        config_arg,
        "--ssd-budget",
        "20M",
    ]);
    let c = agent.cache();
    assert_eq!(
        (c["ram_budget"].as_u64(), c["ssd_budget"].as_u64()),
        (Some(MIB), Some(20 * MIB))
    );

    // --check-config shows the same merge.
    let out = Command::new(agent_bin())
        .args([
            "--config",
            config_arg,
            "--ssd-budget",
            "20M",
            "--check-config",
        ])
        .output()
        .unwrap();
    assert_success(&out);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("ram-budget = \"1M\"") && shown.contains("ssd-budget = \"20M\""),
        "{shown}"
    );

    // SIGHUP: the new file applies, except where a flag decides.
    fs::write(
        &config,
        "ram-budget = \"2M\"\nssd-budget = \"5M\"\nlog-hits = true\n",
    )
    .unwrap();
    agent.signal(libc::SIGHUP);
    wait_until(30, "the new RAM budget", || {
        agent.cache()["ram_budget"].as_u64() == Some(2 * MIB)
    });
    assert_eq!(agent.cache()["ssd_budget"].as_u64(), Some(20 * MIB));
    let file = net.put("c/lib.py", b"y = 2\n");
    read_all(&file);
    wait_until(60, "lib.py to be cached", || {
        agent.settled()["cached_files"] == 1
    });
    job_opens(&agent, 1, &[&file]);
    wait_until(30, "a hit line, switched on by the reload", || {
        agent.log().contains(&format!("hit: {}", file.display()))
    });

    // A bad file changes nothing, and says where it is wrong.
    fs::write(&config, "ram-budget = \"2M\"\n\nssd-budget = \"lots\"\n").unwrap();
    agent.signal(libc::SIGHUP);
    wait_until(30, "the reload to be refused", || {
        agent
            .log()
            .contains("SIGHUP: keeping the running configuration")
    });
    let log = agent.log();
    assert!(log.contains("line 3") && log.contains("\"lots\""), "{log}");
    assert_eq!(agent.cache()["ram_budget"].as_u64(), Some(2 * MIB));

    let out = Command::new(agent_bin())
        .args(["--config", config_arg, "--check-config"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("line 3") && err.contains("is not a size"),
        "{err}"
    );
    fs::write(&config, "ram-budgte = \"2M\"\n").unwrap();
    let out = Command::new(agent_bin())
        .args(["--config", config_arg, "--check-config"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("line 1")
            && err.contains("unknown field `ram-budgte`"),
        "{err}"
    );
}

/// Loaded eBPF programs named `name`, machine-wide.
fn loaded(name: &str) -> usize {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| p.name_as_str() == Some(name))
        .count()
}

#[test]
fn sigterm_detaches_the_programs_saves_the_profile_and_removes_the_socket() {
    let net = NetworkMount::start();
    let before = loaded("syscall_exit");
    let mut agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--save-interval",
        "3600",
    ]);
    assert_eq!(
        loaded("syscall_exit"),
        before + 1,
        "the daemon's programs are loaded"
    );
    let file = net.put("d/data.bin", &vec![7u8; MIB as usize]);
    read_all(&file);
    wait_until(60, "the file to be pinned", || {
        agent.settled()["pinned_files"] == 1
    });
    // Seen after the last periodic save: only the save at exit can keep it.
    let late = net.put("d/late.bin", b"late");
    read_all(&late);
    let socket = agent.socket.clone();
    let state = agent.state_dir.clone();
    let log = agent.stop();
    assert!(log.contains("eBPF programs detached"), "{log}");
    assert!(log.contains("pins released"), "{log}");
    // The kernel frees a detached program once its last perf event is released, a little
    // after the process that held it has exited.
    wait_until(10, "the programs to be unloaded", || {
        loaded("syscall_exit") == before
    });
    assert!(!socket.exists(), "the socket is removed");
    let profile = hocus_tests::saved_profile(&state);
    let paths: Vec<&str> = profile["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(paths.contains(&late.to_str().unwrap()), "{profile:#}");
}

#[test]
fn contrib_and_docs_name_only_metrics_the_agent_exports() {
    let net = NetworkMount::start();
    let file = net.put("e/x.py", b"x = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    agent.settled();
    let page = agent.metrics();
    let exported = sample_names(&page);
    assert!(exported.len() > 20, "{page}");

    let dashboard: Value =
        serde_json::from_slice(&fs::read(repo().join("contrib/grafana-dashboard.json")).unwrap())
            .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    fn collect(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => out.push(e.clone()),
                        _ => collect(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    collect(&dashboard, &mut exprs);
    assert!(exprs.len() >= 8, "the dashboard has panels: {exprs:?}");
    for expr in &exprs {
        let names = names_in(expr);
        assert!(!names.is_empty(), "{expr} queries no hocus metric");
        for name in names {
            assert!(
                exported.contains(&name),
                "the dashboard queries {name}, which is not exported:\n{page}"
            );
        }
    }

    let docs = fs::read_to_string(repo().join("docs/metrics.md")).unwrap();
    // Per-Slurm-job families have samples only once a Slurm job ran: tests/slurm.rs
    // checks them; NFS's own counts only on NFS: tests/coherence.rs does.
    let documented: BTreeSet<String> = names_in(&docs)
        .into_iter()
        .filter(|n| !n.starts_with("hocus_slurm_job_") && n != "hocus_nfs_operations_total")
        .collect();
    for name in &exported {
        assert!(
            documented.contains(name),
            "docs/metrics.md does not document {name}"
        );
    }
    for name in &documented {
        assert!(
            exported.contains(name),
            "docs/metrics.md documents {name}, which is not exported"
        );
    }

    // The example configuration is valid, and so is the unit's command line with it.
    let example = repo().join("contrib/agent.toml");
    let unit = fs::read_to_string(repo().join("contrib/hocus-agent.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart line");
    let args: Vec<String> = exec
        .split_whitespace()
        .skip(1)
        .map(|a| a.replace("/etc/hocus/agent.toml", example.to_str().unwrap()))
        .collect();
    let out = Command::new(agent_bin())
        .args(&args)
        .arg("--check-config")
        .output()
        .unwrap();
    assert_success(&out);
    for key in [
        "Restart=on-failure",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "StateDirectory=hocus",
        "CacheDirectory=hocus",
    ] {
        assert!(unit.contains(key), "the unit lacks {key}");
    }
    // Every daemon flag has its key in the example configuration.
    let help = Command::new(agent_bin()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let example_text = fs::read_to_string(&example).unwrap();
    for flag in help
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("--"))
        .map(|l| l.split(['=', ' ', '[']).next().unwrap())
        .filter(|f| !["config", "check-config", "help", "version"].contains(f))
    {
        assert!(
            example_text.contains(&format!("{flag} =")),
            "contrib/agent.toml does not show the key for --{flag}"
        );
    }
}
