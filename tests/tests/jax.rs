//! A real JAX persistent compilation cache on the network home, used by an ordinary
//! user's jobs under `hocus-agent run`: its entries are served locally once stable, its lock file and
//! `-atime` files (with a maximum cache size) are never bound, and an entry changed on the
//! server is seen by the next job.

use std::{
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Output},
    thread,
    time::Duration,
};

use hocus_tests::{Agent, NetworkMount, assert_success, jax_packages, test_user, wait_until};

/// Compiles three small functions (and what jnp.arange compiles) with the persistent
/// cache in `cache`; prints how many compilations the cache answered, of how many.
fn script(cache: &Path, max_size: Option<u64>) -> String {
    let limit = max_size.map_or(String::new(), |n| {
        format!("jax.config.update('jax_compilation_cache_max_size', {n})\n")
    });
    format!(
        r#"
import logging, jax, jax.numpy as jnp
from jax._src import compilation_cache as cc
jax.config.update('jax_compilation_cache_dir', {cache:?})
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
{limit}hits = []
original = cc.get_executable_and_time
def counting(*a, **k):
    hits.append(False)
    r = original(*a, **k)
    hits[-1] = r[0] is not None
    return r
cc.get_executable_and_time = counting
x = jnp.arange(8.0)
for f in (lambda v: jnp.sin(v) * 2, lambda v: jnp.cos(v) + v, lambda v: (v ** 2).sum()):
    jax.block_until_ready(jax.jit(f)(x))
print(sum(hits), len(hits))
"#,
        cache = cache.display().to_string()
    )
}

struct Jobs<'a> {
    agent: &'a Agent,
    packages: PathBuf,
    home: tempfile::TempDir,
}

impl Jobs<'_> {
    /// A job of the ordinary test user, under `hocus-agent run`.
    fn run(&self, script: &str) -> Output {
        let (uid, gid) = test_user();
        Command::new(hocus_tests::agent_bin())
            .arg("--socket")
            .arg(&self.agent.socket)
            .args(["run", "--", "python3", "-c", script])
            .env("PYTHONPATH", &self.packages)
            .env("JAX_PLATFORMS", "cpu")
            .env("HOME", self.home.path())
            .current_dir("/")
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap()
    }

    /// Runs the script: (cache answers, compilations), and what it said on stderr.
    fn compile(&self, script: &str) -> ((u32, u32), String) {
        let out = self.run(script);
        assert_success(&out);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut n = stdout.split_whitespace().map(|w| w.parse::<u32>().unwrap());
        (
            (n.next().unwrap(), n.next().unwrap()),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("-cache"))
        .collect();
    v.sort();
    v
}

fn local_opens(agent: &Agent) -> u64 {
    agent.status()["cache"]["served"][0]["opens_local"]
        .as_u64()
        .unwrap()
}

fn check(max_size: Option<u64>) {
    let packages = jax_packages();
    // The user's network home: everything on it is theirs.
    let net = NetworkMount::start_owned_by(Some(test_user()));
    fs::create_dir_all(net.server_path("home/jax-cache")).unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "1"]);
    let jobs = Jobs {
        agent: &agent,
        packages,
        home: {
            let home = tempfile::tempdir().unwrap();
            let (uid, gid) = test_user();
            std::os::unix::fs::chown(home.path(), Some(uid), Some(gid)).unwrap();
            home
        },
    };
    let cache = net.path("home/jax-cache");
    let script = script(&cache, max_size);
    // The first job compiles and writes the entries to the share.
    let ((hits, compiled), _) = jobs.compile(&script);
    assert_eq!(hits, 0);
    assert!(compiled >= 3);
    let written = entries(&net.server_path("home/jax-cache"));
    assert_eq!(written.len(), compiled as usize, "{written:?}");
    // With a size limit, JAX keeps a lock file (opened read-write at every lookup) and
    // an -atime file beside each entry (rewritten at every hit): beside the lock, files
    // only written so far wait until a job reads them. So the second job reads the
    // entries from the network (and rewrites their -atime files there), the third from
    // the local copies; with no limit, the second already does.
    if max_size.is_some() {
        let ((hits, lookups), stderr) = jobs.compile(&script);
        assert_eq!((hits, lookups), (compiled, compiled), "{stderr}");
        assert!(!stderr.contains("Warning"), "the job complained:\n{stderr}");
    }
    let copies: Vec<PathBuf> = entries(&cache);
    wait_until(60, "the entries copied", || {
        copies.iter().all(|e| agent.local_copy(e).exists())
    });
    thread::sleep(Duration::from_secs(2));
    let atimes = |dir: &Path| -> Vec<(PathBuf, std::time::SystemTime)> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with("-atime"))
            .map(|p| (p.clone(), fs::metadata(&p).unwrap().modified().unwrap()))
            .collect()
    };
    let atimes_before = atimes(&net.server_path("home/jax-cache"));
    let before = local_opens(&agent);
    let ((hits, lookups), stderr) = jobs.compile(&script);
    assert_eq!((hits, lookups), (compiled, compiled), "{stderr}");
    for word in [
        "Warning",
        "WARNING",
        "Error",
        "PermissionError",
        "Read-only",
    ] {
        assert!(!stderr.contains(word), "the job complained:\n{stderr}");
    }
    wait_until(10, "the entries served locally", || {
        local_opens(&agent) >= before + u64::from(compiled)
    });
    // Its -atime updates reached the share.
    let atimes_after = atimes(&net.server_path("home/jax-cache"));
    assert_eq!(atimes_before.len(), atimes_after.len());
    assert!(
        atimes_before
            .iter()
            .zip(&atimes_after)
            .all(|((_, a), (_, b))| b > a),
        "{atimes_before:?}\n{atimes_after:?}"
    );
    // The lock file and the -atime files (with a size limit) were never copied, and the
    // -atime files the second job rewrote are on the share.
    let kept_off: Vec<PathBuf> = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.to_string_lossy().ends_with("-cache"))
        .collect();
    if max_size.is_some() {
        assert!(!kept_off.is_empty(), "JAX kept no lock or -atime files");
    }
    for f in &kept_off {
        assert!(!agent.local_copy(f).exists(), "{f:?} was copied");
    }
    // An entry deleted on the server, another replaced by garbage: the next job
    // recompiles both (and writes them back), and never reads the old copies.
    fs::remove_file(&written[0]).unwrap();
    fs::write(&written[1], b"garbage").unwrap();
    wait_until(30, "a plain process to see the changes", || {
        !cache.join(written[0].file_name().unwrap()).exists()
            && fs::read(cache.join(written[1].file_name().unwrap())).is_ok_and(|b| b == b"garbage")
    });
    let ((hits, lookups), stderr) = jobs.compile(&script);
    assert_eq!(lookups, compiled, "{stderr}");
    assert!(
        hits <= compiled - 2,
        "stale entries answered: {hits} hits\n{stderr}"
    );
    assert!(
        written[0].exists(),
        "the deleted entry was not written back"
    );
}

#[test]
fn a_jax_compilation_cache_on_the_share_is_served_locally_and_stays_coherent() {
    check(None);
}

#[test]
fn with_a_size_limit_its_lock_and_atime_files_stay_on_the_share() {
    check(Some(1 << 30));
}
