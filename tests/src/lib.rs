//! Fixtures for hocus's integration tests: a real network mount (sshfs over loopback,
//! with its own sshd) and a running hocus-agent. Both are torn down on drop, also when a
//! test panics. Tests run as root; they fail, never skip, when something is missing.

use std::{
    collections::BTreeSet,
    fs,
    io::Read,
    net::TcpListener,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::{fs::PermissionsExt, net::UnixStream, process::CommandExt},
    },
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

pub mod nfs;
pub mod slurm;
mod watchdog;

/// Panics unless we are root: the tests load eBPF programs and mount filesystems.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!(
            "the integration tests need root (real eBPF programs, real mounts): sudo -E cargo xtask test"
        );
    }
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (cargo xtask setup installs it)"));
    if !out.status.success() {
        panic!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// A network mount of a local directory: sshfs over SFTP on 127.0.0.1, or kernel NFS
/// where `HOCUS_TEST_FS` says so (`nfs`, in the rig's guests). `server` is the exported
/// directory (the server's view), `mount` the network filesystem (the client's view).
pub struct NetworkMount {
    dir: tempfile::TempDir,
    pub server: PathBuf,
    pub mount: PathBuf,
    /// The SFTP server; None on NFS.
    sshd: Option<Child>,
    /// The NFS version mounted; None on sshfs.
    pub nfs: Option<nfs::Version>,
    /// On NFS, the client's requests (`server_log`).
    client_log: Option<nfs::ClientLog>,
    /// Where clients reach the server: 127.0.0.1, or an address in a network namespace.
    host: String,
    port: u16,
    owner: Option<(u32, u32)>,
    /// Ends the test with a report if it hangs while the mount lives.
    _watchdog: watchdog::Watchdog,
}

/// Another client's mount of a `NetworkMount`'s export (`another_client`).
pub struct Client {
    pub mount: PathBuf,
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

/// A server stopped by `NetworkMount::pause_server`, going on when dropped.
pub struct PausedServer(Vec<i32>);

impl Drop for PausedServer {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: plain kill(2).
            unsafe { libc::kill(*pid, libc::SIGCONT) };
        }
    }
}

impl NetworkMount {
    /// Starts an sshd on a free loopback port and mounts its export with sshfs.
    pub fn start() -> Self {
        Self::start_owned_by(None)
    }

    /// The mount's filesystem type, as the mount table says it.
    pub fn fs_type(&self) -> &'static str {
        match self.nfs {
            None => "fuse.sshfs",
            Some(nfs::Version::V3) => "nfs",
            Some(nfs::Version::V4) => "nfs4",
        }
    }

    /// A share with a realistic network between client and server: every byte takes
    /// half of `round_trip` each way (a delaying TCP proxy in front of sshd), as on a
    /// cluster's link (1 ms) rather than bare loopback (~20 µs).
    pub fn start_with_round_trip(round_trip: Duration) -> Self {
        Self::start_with(None, Some(round_trip))
    }

    /// A share whose files all belong to one user, as their network home does (the SFTP
    /// server runs as root, so without this, files a user creates through the mount are
    /// root's, and they cannot rewrite them).
    pub fn start_owned_by(owner: Option<(u32, u32)>) -> Self {
        Self::start_with(owner, None)
    }

    /// A share whose directories are made under `parent` instead of the temporary
    /// directory (a job whose /tmp is private, under Slurm's job_container/tmpfs, must
    /// still see it).
    pub fn start_under(parent: &Path) -> Self {
        Self::start_in(parent, None, None)
    }

    fn start_with(owner: Option<(u32, u32)>, round_trip: Option<Duration>) -> Self {
        Self::start_in(&std::env::temp_dir(), owner, round_trip)
    }

    /// A server in the network namespace of process `holder`, listening on `addr`
    /// there, with no client yet: nodes mount it with `mount_in_namespace_of` (at
    /// `mount`, the same path on every node).
    pub fn start_serving_from(holder: u32, addr: &str) -> Self {
        Self::start_at(
            &std::env::temp_dir(),
            None,
            None,
            Some((holder, addr)),
            None,
        )
    }

    fn start_in(parent: &Path, owner: Option<(u32, u32)>, round_trip: Option<Duration>) -> Self {
        Self::start_at(parent, owner, round_trip, None, None)
    }

    /// A kernel NFS share exported and mounted as `share` says (root squashed, with
    /// mount options), its root owned by `owner`: in the rig's guests only, where
    /// `HOCUS_TEST_FS` names an NFS version.
    pub fn start_nfs(owner: Option<(u32, u32)>, share: nfs::Share) -> Self {
        assert!(
            nfs::from_env().is_some(),
            "kernel NFS runs in the rig's guests: cargo xtask vm test --fs nfs3 --test nfs"
        );
        Self::start_at(&std::env::temp_dir(), owner, None, None, Some(share))
    }

    fn start_at(
        parent: &Path,
        owner: Option<(u32, u32)>,
        round_trip: Option<Duration>,
        remote: Option<(u32, &str)>,
        share: Option<nfs::Share>,
    ) -> Self {
        require_root();
        let _watchdog = watchdog::Watchdog::start();
        let dir = tempfile::Builder::new()
            .prefix("hocus-net-")
            .tempdir_in(parent)
            .expect("temporary directory");
        // Ordinary users in the tests must be able to reach the mount.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let root = dir.path().to_owned();
        let server = root.join("export");
        let mount = root.join("net");
        fs::create_dir_all(&server).unwrap();
        fs::set_permissions(&server, fs::Permissions::from_mode(0o755)).unwrap();
        fs::create_dir_all(&mount).unwrap();
        _watchdog.leaves(watchdog::Leftover::Mount(mount.clone()));
        if let Some(version) = nfs::from_env() {
            assert!(remote.is_none(), "a remote server is sshfs's only");
            if let Some((u, g)) = owner {
                std::os::unix::fs::chown(&server, Some(u), Some(g)).unwrap();
            }
            nfs::export_and_mount(&server, &mount, version, share.unwrap_or_default());
            let mount = fs::canonicalize(&mount).unwrap();
            let client_log = Some(nfs::ClientLog::start(&mount, &server));
            return Self {
                dir,
                server,
                mount,
                sshd: None,
                nfs: Some(version),
                client_log,
                host: "127.0.0.1".to_owned(),
                port: 2049,
                owner,
                _watchdog,
            };
        }
        fs::create_dir_all("/run/sshd").unwrap();

        for key in ["host_key", "client_key"] {
            run(Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(root.join(key)));
        }
        fs::copy(root.join("client_key.pub"), root.join("authorized_keys")).unwrap();
        let (host, port) = match remote {
            Some((_, addr)) => (addr.to_owned(), 22),
            None => ("127.0.0.1".to_owned(), free_port()),
        };
        let config = root.join("sshd_config");
        fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress {host}\nHostKey {root}/host_key\n\
                 PermitRootLogin prohibit-password\nAuthorizedKeysFile {root}/authorized_keys\n\
                 StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 UsePAM no\nPidFile {root}/sshd.pid\n\
                 Subsystem sftp /usr/lib/openssh/sftp-server -e -l VERBOSE 2>>{root}/sftp.log\n",
                root = root.display()
            ),
        )
        .unwrap();
        let mut sshd = Command::new("nsenter");
        if let Some((holder, _)) = remote {
            sshd.args(["-t", &holder.to_string(), "-n"]);
        }
        let sshd = sshd
            .arg("/usr/sbin/sshd")
            .args(["-D", "-e", "-f"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(fs::File::create(root.join("sshd.log")).unwrap())
            .spawn()
            .expect("starting /usr/sbin/sshd (cargo xtask setup installs openssh-server)");
        _watchdog.leaves(watchdog::Leftover::Process(sshd.id()));
        let deadline = Instant::now() + Duration::from_secs(10);
        let listening = || match remote {
            // Out of reach from here: its log says when it listens.
            Some(_) => fs::read_to_string(root.join("sshd.log"))
                .is_ok_and(|l| l.contains("Server listening")),
            None => std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        };
        while !listening() {
            assert!(
                Instant::now() < deadline,
                "sshd did not start: {}",
                fs::read_to_string(root.join("sshd.log")).unwrap_or_default()
            );
            thread::sleep(Duration::from_millis(50));
        }
        // sshfs talks to the proxy, when there is one.
        let port = match round_trip {
            Some(rtt) => delay_proxy(port, rtt / 2),
            None => port,
        };
        let mut this = Self {
            dir,
            server,
            mount,
            sshd: Some(sshd),
            nfs: None,
            host,
            port,
            owner,
            client_log: None,
            _watchdog,
        };
        if remote.is_some() {
            return this;
        }
        run(&mut this.sshfs(&this.mount));
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            mounts.contains(&format!(" {} ", this.mount.display())),
            "sshfs reported success but {} is not mounted",
            this.mount.display()
        );
        this.mount = fs::canonicalize(&this.mount).unwrap();
        this
    }

    /// The sshfs command that mounts the export at `at`.
    fn sshfs(&self, at: &Path) -> Command {
        let mut cmd = Command::new("sshfs");
        cmd.args(["-p", &self.port.to_string(), "-o"])
            .arg(format!(
                // dcache_timeout=1: changes made on the server show within a second, as
                // NFS's attribute cache would with actimeo=1.
                "IdentityFile={}/client_key,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,allow_other,default_permissions,BatchMode=yes,dcache_timeout=1{}",
                self.dir.path().display(),
                self.owner
                    .map_or(String::new(), |(u, g)| format!(",uid={u},gid={g}"))
            ))
            .arg(format!("root@{}:{}", self.host, self.server.display()))
            .arg(at);
        cmd
    }

    /// Another sshfs client of the same server on this machine, mounted with `options`
    /// added (caching of its own, say): unmounted when dropped.
    pub fn another_client(&self, options: &str) -> Client {
        assert!(self.nfs.is_none(), "another client is sshfs's only");
        let at = self.dir.path().join("net-again");
        fs::create_dir_all(&at).unwrap();
        self._watchdog.leaves(watchdog::Leftover::Mount(at.clone()));
        run(self.sshfs(&at).args(["-o", options]));
        Client {
            mount: fs::canonicalize(&at).unwrap(),
        }
    }

    /// Mounts the same export again at `at` in the mount namespace of process `holder`:
    /// another client of the same server, as another node would be.
    pub fn mount_in_namespace_of(&self, holder: u32, at: &Path) {
        let mount = match self.nfs {
            // Another node's client: a superblock of its own (the kernel would share
            // one between mounts of the same export).
            Some(version) => nfs::mount_command(&self.server, at, version, "nosharecache"),
            None => self.sshfs(at),
        };
        run(Command::new("nsenter")
            .args(["-t", &holder.to_string(), "-m", "-n", "--"])
            .arg(mount.get_program())
            .args(mount.get_args()));
    }

    /// Kills the server side (sshd and the sshfs client process): the mount stays, dead,
    /// as when a file server goes away.
    pub fn kill_server(&self) {
        if self.nfs.is_some() {
            // The export goes: its clients' requests fail from now on.
            nfs::unexport(&self.server);
            let _ = Command::new("exportfs").arg("-f").status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while fs::read_dir(&self.mount).is_ok() {
                assert!(
                    Instant::now() < deadline,
                    "{} still answers",
                    self.mount.display()
                );
                thread::sleep(Duration::from_millis(100));
            }
            return;
        }
        let _ = Command::new("pkill")
            .arg("-KILL")
            .arg("-f")
            .arg(format!("sshfs .*{}", self.mount.display()))
            .status();
        if let Some(sshd) = &self.sshd {
            // SAFETY: plain kill(2) on our child.
            unsafe { libc::kill(sshd.id() as i32, libc::SIGKILL) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while fs::metadata(&self.mount).is_ok() {
            assert!(
                Instant::now() < deadline,
                "{} still answers",
                self.mount.display()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server answering (its sshd and every process under it: SIGSTOP) until
    /// the value returned is dropped: a file server that hangs. sshfs only.
    pub fn pause_server(&self) -> PausedServer {
        let sshd = self.sshd.as_ref().expect("an sshfs fixture").id() as i32;
        let mut pids = vec![sshd];
        let mut i = 0;
        // Its descendants: the session's sshd, the sftp-server.
        while i < pids.len() {
            let parent = pids[i];
            for entry in fs::read_dir("/proc").unwrap().flatten() {
                let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let stat = fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
                // After the command's closing parenthesis: state, then the parent's pid.
                let ppid = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .and_then(|p| p.parse::<i32>().ok());
                if ppid == Some(parent) && !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
            i += 1;
        }
        for pid in &pids {
            // SAFETY: plain kill(2).
            unsafe { libc::kill(*pid, libc::SIGSTOP) };
        }
        PausedServer(pids)
    }

    /// A path on the network mount.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.mount.join(rel)
    }

    /// The same path on the server side (changes made behind the client's back).
    pub fn server_path(&self, rel: &str) -> PathBuf {
        self.server.join(rel)
    }

    /// Creates a file on the server side with the given content.
    pub fn put(&self, rel: &str, content: &[u8]) -> PathBuf {
        let path = self.server_path(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, content).unwrap();
        // On NFS owners are real: what sshfs's uid= shows, the server holds.
        if let (Some(_), Some((u, g))) = (self.nfs, self.owner) {
            let mut p = path.as_path();
            while p != self.server {
                std::os::unix::fs::chown(p, Some(u), Some(g)).unwrap();
                p = p.parent().unwrap();
            }
        }
        self.path(rel)
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// The server's log: every SFTP open, opendir and stat it was asked for, by path on
    /// the server. On NFS, the requests the client made for this mount
    /// (`nfs::ClientLog`): lookups, listings and reads.
    pub fn server_log(&self) -> String {
        match &self.client_log {
            Some(log) => log.text(),
            None => fs::read_to_string(self.dir.path().join("sftp.log")).unwrap_or_default(),
        }
    }

    /// Operations the server has answered so far, by its own count: on sshfs, the
    /// requests its SFTP server logged (opens, listings, stats); on NFS, nfsd's count of
    /// operations (`/proc/net/rpc/nfsd`: NFSv3's procedures and NFSv4's operations
    /// inside compounds; the guest's nfsd serves the tests alone, one at a time).
    pub fn server_operations(&self) -> u64 {
        if self.nfs.is_none() {
            return self.server_log().lines().count() as u64;
        }
        let counts = fs::read_to_string("/proc/net/rpc/nfsd").unwrap_or_default();
        counts
            .lines()
            .filter(|l| l.starts_with("proc3 ") || l.starts_with("proc4ops "))
            .flat_map(|l| l.split_whitespace().skip(2))
            .filter_map(|n| n.parse::<u64>().ok())
            .sum()
    }

    /// Drops what the client holds of the mount (its dentries, attributes and pages: all
    /// the machine's, by `drop_caches`), so that a job reading the network shows in the
    /// server's log on NFS too, whose client would otherwise answer it from its caches
    /// (close-to-open revalidation asks only for attributes, which the log leaves out).
    pub fn drop_client_caches(&self) {
        fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    }

    /// A Python package `mypkg` (`import mypkg.core; mypkg.core.VALUE` is 41) in the
    /// directory `lib` of the share, installed long ago (see `installed_long_ago`, for
    /// `env`). Returns the bytes of its files.
    pub fn put_python_package(&self, lib: &str) -> u64 {
        const FILES: [(&str, &[u8]); 2] = [
            ("mypkg/__init__.py", b"from . import core\n"),
            ("mypkg/core.py", b"VALUE = 41\n"),
        ];
        for (name, content) in FILES {
            self.put(&format!("{lib}/{name}"), content);
        }
        FILES.iter().map(|(_, c)| c.len() as u64).sum()
    }

    /// Dates everything under `rel` of the share two hours back, as an environment
    /// installed long before the jobs run: no directory changed within the seconds that
    /// make hocus's job-start check list it from the server (mtimes are whole seconds
    /// there).
    pub fn installed_long_ago(&self, rel: &str) {
        run(Command::new("find").arg(self.server_path(rel)).args([
            "-exec",
            "touch",
            "-h",
            "-d",
            "2 hours ago",
            "{}",
            "+",
        ]));
    }

    /// The bytes the server sent of files under `rel` since its log was `before` long.
    pub fn bytes_served_inside(&self, rel: &str, before: usize) -> u64 {
        let inside = format!("\"{}/", self.server_path(rel).display());
        self.server_log()[before..]
            .lines()
            // SFTP's close of a file says what was read through it; NFS's reads each.
            .filter(|l| {
                l.contains(&format!("close {inside}")) || l.starts_with(&format!("read {inside}"))
            })
            .filter_map(|l| {
                l.split(" bytes read ")
                    .nth(1)?
                    .split(' ')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    }

    /// What a job asked the server inside `rel` of the share since the log was `before`
    /// bytes long, leaving out what hocus asks as a job starts: its check stats each
    /// directory and file of a snapshot from the server (so the job sees what the
    /// network holds), and mounting a snapshot's overlay asks the network filesystem for
    /// its limits (overlayfs checks each layer's name length: one statvfs of the
    /// snapshot's directory). A job served by a snapshot sends nothing else: no open,
    /// no read, no listing, no lookup of a missing name.
    pub fn job_requests_inside(&self, rel: &str, before: usize) -> Vec<String> {
        let inside = format!("\"{}/", self.server_path(rel).display());
        self.server_log()[before..]
            .lines()
            .filter(|l| l.contains(&inside))
            .filter(|l| {
                let entry = |prefix: &str| {
                    l.strip_prefix(prefix)
                        .and_then(|p| p.strip_suffix('"'))
                        .is_some_and(|p| Path::new(p).symlink_metadata().is_ok())
                };
                // NFS: the check's walk may look an entry up again.
                !entry("lstat name \"") && !entry("statvfs \"") && !entry("lookup \"")
            })
            .map(str::to_owned)
            .collect()
    }
}

/// A fresh local filesystem, as a node's own SSD holds its cache: ext4 with its journal
/// on a loop device over a sparse file. Benchmarks put the cache here rather than in
/// /tmp: a root filesystem without a journal that just deleted thousands of files (the
/// benchmark's own trees) makes every file created scan for an inode not recently
/// freed (ext4's `recently_deleted`), a cost a node's cache disk does not have.
pub struct LocalDisk {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl LocalDisk {
    pub fn new(size_mib: u64) -> Self {
        require_root();
        let dir = tempfile::Builder::new()
            .prefix("hocus-disk-")
            .tempdir()
            .expect("temporary directory");
        let image = dir.path().join("disk.img");
        fs::File::create(&image)
            .and_then(|f| f.set_len(size_mib << 20))
            .expect("the disk image");
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image));
        let path = dir.path().join("mnt");
        fs::create_dir(&path).unwrap();
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&path));
        Self { _dir: dir, path }
    }
}

impl Drop for LocalDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

impl Drop for NetworkMount {
    fn drop(&mut self) {
        if self.nfs.is_some() {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.mount)
                .stderr(Stdio::null())
                .status();
            nfs::remove(&self.server);
            return;
        }
        if self.host != "127.0.0.1" {
            // Mounted only in nodes' namespaces: their sshfs clients go with the server.
            let _ = Command::new("pkill")
                .arg("-f")
                .arg(format!("sshfs .*{}:{}", self.host, self.server.display()))
                .status();
            if let Some(sshd) = &mut self.sshd {
                let _ = sshd.kill();
                let _ = sshd.wait();
            }
            return;
        }
        // Lazy unmount: a test may have left a process with a file open on it.
        let _ = Command::new("fusermount3")
            .arg("-uz")
            .arg(&self.mount)
            .status();
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mount)
            .stderr(Stdio::null())
            .status();
        if let Some(sshd) = &mut self.sshd {
            let _ = sshd.kill();
            let _ = sshd.wait();
        }
    }
}

/// Listens on a loopback port and forwards every connection to `target`, delaying each
/// byte by `one_way` in each direction. Runs for as long as the process.
fn delay_proxy(target: u16, one_way: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", target)) else {
                continue;
            };
            for s in [&client, &server] {
                let _ = s.set_nodelay(true);
            }
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            delayed_pipe(client, server, one_way);
            delayed_pipe(s2, c2, one_way);
        }
    });
    port
}

/// Copies `from` to `to`, each chunk sent `delay` after it arrived.
fn delayed_pipe(mut from: std::net::TcpStream, mut to: std::net::TcpStream, delay: Duration) {
    use std::io::Write;
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0
                || tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
    thread::spawn(move || {
        for (at, chunk) in rx {
            if let Some(wait) = at.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The hocus-agent binary under test (built by `cargo xtask test`).
/// The profile saved in a state directory, read as root with no daemon running (the
/// state itself is binary: a snapshot and a journal).
pub fn saved_profile(state_dir: &Path) -> serde_json::Value {
    let out = std::process::Command::new(agent_bin())
        .args(["--socket", "/nonexistent/agent.sock", "--state-dir"])
        .arg(state_dir)
        .args(["profile", "export"])
        .output()
        .unwrap();
    assert_success(&out);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Whether the hocus-agent at `bin` has the daemon flag `flag` (its `--help` names it),
/// asked once per binary and flag: every daemon a test starts wants to know.
fn knows_flag(bin: &Path, flag: &str) -> bool {
    static KNOWN: Mutex<Vec<(PathBuf, String, bool)>> = Mutex::new(Vec::new());
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, has)) = known.iter().find(|(b, f, _)| b == bin && f == flag) {
        return *has;
    }
    let has = Command::new(bin)
        .arg("--help")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains(flag));
    known.push((bin.to_owned(), flag.to_owned(), has));
    has
}

pub fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("HOCUS_AGENT_BIN") {
        return PathBuf::from(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/hocus-agent");
    assert!(
        p.exists(),
        "no hocus-agent binary at {}: run the tests with cargo xtask test",
        p.display()
    );
    p
}

/// A running hocus-agent daemon with its own state directory and control socket.
pub struct Agent {
    pub dir: tempfile::TempDir,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    /// The cache directory (`--cache-dir`), inside `dir` unless the test named one.
    pub cache_dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
    /// Ends the test with a report if it hangs with this daemon.
    _watchdog: watchdog::Watchdog,
}

/// A daemon's own directory (socket, state, cache, log), under `parent`.
fn agent_dir(parent: &Path) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("hocus-agent-")
        .tempdir_in(parent)
        .unwrap();
    // Ordinary users in the tests must reach the control socket.
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

impl Agent {
    /// Starts the daemon with `args` (e.g. `["--watch", path]`) and waits until it answers.
    pub fn start(args: &[&str]) -> Self {
        Self::start_under(&std::env::temp_dir(), args)
    }

    /// Starts the daemon with its directories under `parent` (see
    /// `NetworkMount::start_under`).
    pub fn start_under(parent: &Path, args: &[&str]) -> Self {
        let dir = agent_dir(parent);
        let state_dir = dir.path().join("state");
        Self::start_with_state(dir, state_dir, args)
    }

    /// Starts the daemon in the mount namespace of process `holder` (through nsenter).
    pub fn start_in_namespace_of(holder: u32, args: &[&str]) -> Self {
        let dir = agent_dir(&std::env::temp_dir());
        let state_dir = dir.path().join("state");
        let holder = holder.to_string();
        Self::launch(
            dir,
            state_dir,
            args,
            &["nsenter", "-t", &holder, "-m", "-n", "--"],
        )
    }

    /// Starts the daemon as on an older kernel: taking `fallbacks` (comma-separated, or
    /// `all`: hocus-agent's `HOCUS_FALLBACKS`) where this kernel has what the preferred
    /// way needs. It inherits a descriptor without close-on-exec (9), as a daemon
    /// started by a careless parent does: no job may get it.
    pub fn start_with_fallbacks(fallbacks: &str, args: &[&str]) -> Self {
        let dir = agent_dir(&std::env::temp_dir());
        let state_dir = dir.path().join("state");
        let script = format!("exec 9</dev/null; exec env HOCUS_FALLBACKS={fallbacks} \"$@\"");
        Self::launch(dir, state_dir, args, &["sh", "-c", &script, "sh"])
    }

    /// Starts a daemon on an existing state directory (a restart).
    pub fn start_with_state(dir: tempfile::TempDir, state_dir: PathBuf, args: &[&str]) -> Self {
        Self::launch(dir, state_dir, args, &[])
    }

    fn launch(dir: tempfile::TempDir, state_dir: PathBuf, args: &[&str], wrapper: &[&str]) -> Self {
        require_root();
        let socket = dir.path().join("agent.sock");
        let log = unique(dir.path().join("agent.log"));
        let cache_dir = match args.iter().position(|a| *a == "--cache-dir") {
            Some(i) => PathBuf::from(args[i + 1]),
            None => dir.path().join("cache"),
        };
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(agent_bin());
                c
            }
            None => Command::new(agent_bin()),
        };
        if !args.contains(&"--cache-dir") {
            cmd.arg("--cache-dir").arg(&cache_dir);
        }
        // A port of its own, and no machine-wide /etc/hocus/agent.toml.
        if !args
            .iter()
            .any(|a| a.starts_with("--metrics-addr") || a.starts_with("--no-metrics"))
        {
            cmd.arg("--metrics-addr=127.0.0.1:0");
        }
        // Tracing never rests unless a test asks: a test's counts do not depend on how
        // long it waited (tests/rest.rs tests resting). An older build compared with in a
        // benchmark knows no such flag, and never rests.
        if !args.contains(&"--rest-after") && knows_flag(&agent_bin(), "--rest-after") {
            cmd.args(["--rest-after", "0"]);
        }
        if !args.contains(&"--config") {
            let empty = dir.path().join("empty.toml");
            fs::write(&empty, "").unwrap();
            cmd.arg("--config").arg(empty);
        }
        let child = cmd
            .args(args)
            .arg("--state-dir")
            .arg(&state_dir)
            .arg("--socket")
            .arg(&socket)
            .env(
                "RUST_LOG",
                std::env::var("HOCUS_TEST_AGENT_LOG").unwrap_or("info".into()),
            )
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting hocus-agent");
        let _watchdog = watchdog::Watchdog::daemon(child.id(), log.clone());
        let mut agent = Self {
            dir,
            state_dir,
            socket,
            cache_dir,
            child: Some(child),
            log,
            _watchdog,
        };
        let bound = patience(60);
        let deadline = Instant::now() + bound;
        while UnixStream::connect(&agent.socket).is_err() {
            if let Ok(Some(status)) = agent.child.as_mut().unwrap().try_wait() {
                panic!(
                    "hocus-agent exited ({status}) before it was ready:\n{}",
                    agent.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "hocus-agent was not ready within {} s:\n{}",
                bound.as_secs(),
                agent.log()
            );
            thread::sleep(Duration::from_millis(50));
        }
        agent
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// A CLI command against this daemon (`hocus-agent --socket .. --state-dir .. ARGS`).
    pub fn cli(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(agent_bin());
        cmd.arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(args);
        cmd
    }

    /// `prefetch --profile profile` as root; it must succeed.
    pub fn prefetch(&self, profile: &Path) {
        assert_success(
            &self
                .cli(&["prefetch", "--profile", profile.to_str().unwrap()])
                .output()
                .unwrap(),
        );
    }

    /// `prefetch --profile profile` as user `(uid, gid)`, from the profile's directory; it
    /// must end within 60 s.
    pub fn prefetch_as(
        &self,
        profile: &Path,
        (uid, gid): (u32, u32),
        what: &str,
    ) -> std::process::Output {
        finished_within(
            self.cli(&["prefetch", "--profile", profile.to_str().unwrap()])
                .current_dir(profile.parent().unwrap())
                .uid(uid)
                .gid(gid),
            60,
            what,
        )
    }

    /// `python3 -c script` as a job under `hocus-agent run`, as root, from `/`.
    pub fn python_job(&self, script: &str) -> Command {
        let mut cmd = self.cli(&["run", "--", "python3", "-c", script]);
        cmd.current_dir("/");
        cmd
    }

    /// The same job started, its output kept (`wait_with_output`).
    pub fn python_job_started(&self, script: &str) -> std::process::Child {
        self.python_job(script)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the job")
    }

    /// `script` (Python, with the packages in `packages` importable) as a job; what it
    /// printed. It must succeed.
    pub fn python_with(&self, packages: &Path, script: &str) -> String {
        let file = tempfile::Builder::new().suffix(".py").tempfile().unwrap();
        fs::write(file.path(), script).unwrap();
        let out = self.run_job(&format!(
            "PYTHONDONTWRITEBYTECODE=1 PYTHONPATH={} python3 {}",
            packages.display(),
            file.path().display()
        ));
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `sh -c script` as a job under `hocus-agent run`, as root, from `/`.
    pub fn run_job(&self, script: &str) -> Output {
        self.cli(&["run", "--", "sh", "-c", script])
            .current_dir("/")
            .output()
            .unwrap()
    }

    /// `profile export` as root, parsed.
    pub fn export(&self) -> Value {
        let out = run(&mut self.cli(&["profile", "export"]));
        serde_json::from_slice(&out.stdout).expect("export prints JSON")
    }

    /// The way `status` says the daemon takes for `part` (docs/kernels.md's routes).
    pub fn route(&self, part: &str) -> String {
        let status = self.status();
        status["routes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["part"] == part)
            .unwrap_or_else(|| panic!("no route for {part}: {status:#}"))["way"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// `status --json`, asked on the control socket itself: a poll that started the CLI
    /// (a process, its loader, its runtime) cost far more than the daemon's answer, and
    /// under the rig's emulation, where waits poll every 100 ms, it took the guest's
    /// CPU from the daemon being waited for.
    /// The operations the daemon counted asking the servers for `purpose` (`status`).
    pub fn asked_for(&self, purpose: &str) -> u64 {
        self.status()["server"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["purpose"] == purpose)
            .filter_map(|e| e["operations"].as_u64())
            .sum()
    }

    /// The entries the daemon's last job start checked against the server (its log).
    /// The copies its last job start bound, and how long it checked them against the
    /// network (ms).
    pub fn last_start_bound(&self) -> (u64, f64) {
        let log = self.log();
        let line = log
            .lines()
            .rfind(|l| l.contains("job start: "))
            .unwrap_or_else(|| panic!("no job start in {log}"));
        let copies = line
            .split("job start: ")
            .nth(1)
            .and_then(|l| l.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        let took = line
            .split(" against the network in ")
            .nth(1)
            .and_then(|l| l.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        (copies, took)
    }

    pub fn last_start_entries(&self) -> u64 {
        let log = self.log();
        log.lines()
            .rfind(|l| l.contains("job start: "))
            .and_then(|l| l.split(" ms, ").nth(1)?.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no job start in {log}"))
    }

    pub fn status(&self) -> Value {
        use std::io::{BufRead, Write};
        let mut stream = UnixStream::connect(&self.socket)
            .unwrap_or_else(|e| panic!("the control socket {}: {e}", self.socket.display()));
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        stream.write_all(b"{\"request\":\"status\"}\n").unwrap();
        let mut line = String::new();
        std::io::BufReader::new(stream)
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("the daemon's status: {e}\n{}", self.log()));
        let mut answer: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the daemon's status {line:?}: {e}\n{}", self.log()));
        assert_eq!(answer["response"], "status", "{line}");
        answer.as_object_mut().unwrap().remove("response");
        answer
    }

    /// The daemon's programs attached now (`syscall_exit`, `fuse_request` ...), from its
    /// descriptors' fdinfo: the kernel's own account of its BPF links, each naming its
    /// program's id, whose name the kernel gives (older kernels name no tracepoint
    /// there).
    pub fn attached(&self) -> Vec<String> {
        let dir = format!("/proc/{}/fdinfo", self.pid());
        fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .filter_map(|e| fs::read_to_string(e.ok()?.path()).ok())
            .filter(|info| info.contains("link_type:"))
            .filter_map(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("prog_id:"))
                    .and_then(|id| id.trim().parse().ok())
            })
            .map(|id| program_name(id).unwrap_or_else(|e| panic!("BPF program {id}: {e}")))
            .collect()
    }

    /// A kernel counter from `status`.
    pub fn kernel_counter(&self, name: &str) -> u64 {
        let status = self.status();
        status["kernel"]
            .as_array()
            .unwrap()
            .iter()
            .find(|pair| pair[0] == name)
            .unwrap_or_else(|| panic!("no kernel counter {name} in {status}"))[1]
            .as_u64()
            .unwrap()
    }

    /// Where the daemon serves metrics.
    pub fn metrics_addr(&self) -> String {
        let status = self.status();
        status["metrics_addr"]
            .as_str()
            .unwrap_or_else(|| panic!("no metrics address in {status}"))
            .to_owned()
    }

    /// GET /metrics, as curl or promtool would (the classic text format).
    pub fn metrics(&self) -> String {
        http_get(&self.metrics_addr(), "/metrics")
    }

    /// The value of one sample of `/metrics` (`name{labels}` as written there), or 0.
    pub fn metric(&self, sample: &str) -> u64 {
        let page = self.metrics();
        page.lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
            .map_or(0, |v| v.trim().parse().unwrap())
    }

    /// Sends the daemon a signal (SIGHUP: reload the configuration).
    pub fn signal(&self, signal: i32) {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(self.pid() as i32, signal) };
    }

    /// The cache part of `status`.
    pub fn cache(&self) -> Value {
        self.status()["cache"].clone()
    }

    /// Waits (at most 30 s) until the daemon holds a snapshot of `dir`.
    pub fn wait_for_snapshot(&self, dir: &Path) {
        wait_until(30, &format!("a snapshot of {}", dir.display()), || {
            self.cache()["snapshots"]
                .as_array()
                .is_some_and(|s| s.iter().any(|p| p == dir.to_str().unwrap()))
        });
    }

    /// Waits until the keeper has no copy under way and its counts stop changing (but
    /// its counts of revalidations, which go on while nothing changes).
    pub fn settled(&self) -> Value {
        let deadline = Instant::now() + patience(60);
        let mut last = Value::Null;
        loop {
            let mut c = self.cache();
            if let Some(counts) = c.as_object_mut() {
                counts.remove("revalidations");
                counts.remove("revalidations_idle");
            }
            if c["copying"] == 0 && c == last {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "the cache did not settle: {c:#}\n{}",
                self.log()
            );
            last = c;
            thread::sleep(Duration::from_millis(2500));
        }
    }

    /// Waits until the keeper has finished `n` more revalidations than when called (its
    /// own count, in `status`; one every `--revalidate`): the turns a test needs it to
    /// have taken before it looks at what it did not do. Panics after 90 s
    /// (`patience`) with what it saw.
    pub fn wait_for_revalidations(&self, n: u64) -> Value {
        let count = |c: &Value| c["revalidations"].as_u64().unwrap_or(0);
        let first = count(&self.cache());
        let deadline = Instant::now() + patience(90);
        let mut poll = Poll::default();
        loop {
            let c = self.cache();
            if count(&c) >= first + n {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "waited {} s for {n} revalidations; saw {}: {c:#}\n{}",
                patience(90).as_secs(),
                count(&c) - first,
                self.log()
            );
            poll.pause();
        }
    }

    /// Where the daemon keeps its copy of `path`.
    pub fn local_copy(&self, path: &Path) -> PathBuf {
        self.cache_dir
            .join("files")
            .join(path.strip_prefix("/").unwrap())
    }

    /// Stops the daemon with SIGTERM and returns its log; it must exit cleanly.
    pub fn stop(&mut self) -> String {
        let mut child = self.child.take().expect("running");
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + patience(30);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "hocus-agent exited with {status}:\n{}",
                    self.log()
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "hocus-agent did not stop on SIGTERM:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(50));
        }
        self.log()
    }

    /// Kills the daemon with SIGKILL, as a crash would, and reaps it.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stops the daemon and hands back its directory and state directory for a restart.
    pub fn stop_for_restart(mut self) -> (tempfile::TempDir, PathBuf) {
        self.stop();
        self.into_dirs()
    }

    /// The directory and state directory of a daemon that no longer runs (a guard it
    /// left is left for the next daemon on them).
    pub fn into_dirs(mut self) -> (tempfile::TempDir, PathBuf) {
        assert!(self.child.is_none(), "stop or kill the daemon first");
        self.cache_dir = PathBuf::new();
        let dir = tempfile::Builder::new()
            .prefix("hocus-agent-")
            .tempdir()
            .unwrap();
        let dir = std::mem::replace(&mut self.dir, dir);
        (dir, self.state_dir.clone())
    }
}

fn unique(p: PathBuf) -> PathBuf {
    let mut n = 0;
    let mut candidate = p.clone();
    while candidate.exists() {
        n += 1;
        candidate = p.with_extension(format!("{n}.log"));
    }
    candidate
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            if thread::panicking() {
                eprintln!("--- hocus-agent log ---\n{}", self.log());
            }
        }
        self.stop_guard();
    }
}

impl Agent {
    /// Kills the guard of the daemon's partial copies, if it left one (a daemon killed
    /// leaves it holding marks on files of its cache, whose filesystem a test unmounts).
    pub fn stop_guard(&self) {
        if self.cache_dir.as_os_str().is_empty() {
            return; // left for the next daemon (`into_dirs`)
        }
        let pid_file = self.cache_dir.join("guard.pid");
        if let Some(pid) = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            let named = fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "hocus-guard");
            if named {
                // SAFETY: plain kill(2) of a process the daemon forked.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = fs::remove_file(&pid_file);
        }
    }
}

/// A plain HTTP/1.1 GET: the status line and the body.
fn get(addr: &str, path: &str) -> std::io::Result<(String, String)> {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.lines().next().unwrap_or_default().to_owned();
    Ok((status, body.to_owned()))
}

/// GET http://ADDR/PATH: the body, or a panic naming what went wrong.
pub fn http_get(addr: &str, path: &str) -> String {
    match get(addr, path) {
        Ok((status, body)) if status.starts_with("HTTP/1.1 200") => body,
        Ok((status, _)) => panic!("GET http://{addr}{path}: {status}"),
        Err(e) => panic!("GET http://{addr}{path}: {e}"),
    }
}

/// GET http://ADDR/PATH: the body if the answer was 200 OK.
pub fn try_http_get(addr: &str, path: &str) -> Option<String> {
    match get(addr, path) {
        Ok((status, body)) if status.contains(" 200 ") => Some(body),
        _ => None,
    }
}

pub fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "the command failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether the running kernel is Linux `major.minor` or newer.
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>());
    match (parts.next(), parts.next()) {
        (Some(Ok(a)), Some(Ok(b))) => (a, b) >= (major, minor),
        _ => panic!("an unreadable kernel release: {release}"),
    }
}

/// A job in the background (`hocus-agent run`, `srun`), and the file its shell wrote its
/// pid to: both killed if the test fails before it ends (a shell left looping over a
/// network mount would hold the mount's teardown).
pub struct BackgroundJob(pub std::process::Child, pub PathBuf);

impl BackgroundJob {
    /// Waits (at most 60 s) for the job to end; whether it succeeded.
    pub fn wait(&mut self) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status.success();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the job did not end within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for BackgroundJob {
    fn drop(&mut self) {
        if let Some(pid) = fs::read_to_string(&self.1)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // SAFETY: plain kill(2).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `cond` until it holds, or panics with `what` after `secs`.
pub fn wait_until(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let bound = patience(secs);
    let deadline = Instant::now() + bound;
    let mut poll = Poll::default();
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "waited {} s for {what}",
            bound.as_secs()
        );
        poll.pause();
    }
}

/// The pause between two looks of a wait: 20 ms at first, half again as long each time
/// up to 500 ms. A short wait ends at once; a long one does not ask the daemon ten times
/// a second (each answer is a sweep of what the kernel side counted: under the rig's
/// emulation the asking took the CPU of what was waited for).
pub struct Poll(Duration);

impl Default for Poll {
    fn default() -> Self {
        Self(Duration::from_millis(20))
    }
}

impl Poll {
    pub fn pause(&mut self) {
        thread::sleep(self.0);
        self.0 = (self.0 * 3 / 2).min(Duration::from_millis(500));
    }
}

/// `len` bytes counting up from 0 and wrapping at 251 (a prime: no page or record
/// boundary lines up with it): `repeating_bytes(len, 251, 0)`.
pub fn counting_bytes(len: usize) -> Vec<u8> {
    repeating_bytes(len, 251, 0)
}

/// `len` bytes, byte `i` being `first + i % period` (wrapping), as
/// `(0..len).map(|i| first.wrapping_add((i % period) as u8))` makes them but copied a
/// period at a time: the tests are built unoptimized, and byte by byte 64 MiB took 2 s
/// on the host and over a minute of an emulated guest.
pub fn repeating_bytes(len: usize, period: u8, first: u8) -> Vec<u8> {
    assert!(period > 0, "a period of no bytes repeats nothing");
    let period: Vec<u8> = (0..period).map(|i| first.wrapping_add(i)).collect();
    let mut bytes = Vec::with_capacity(len);
    while bytes.len() < len {
        let n = period.len().min(len - bytes.len());
        bytes.extend_from_slice(&period[..n]);
    }
    bytes
}

/// The variable the rig sets in a guest it emulates (no KVM): the CPU there is some
/// 25 times slower than the host's, and shared with another guest and the host's lane.
pub const EMULATED: &str = "HOCUS_TEST_EMULATED";

/// How long a wait of `secs` on the host may take here: four times as long in an
/// emulated guest, where a daemon's start alone (the kernel's verifier) takes 25-60 s.
/// A bound that is only a deadline for something that should happen; never a bound a
/// test proves is not crossed.
pub fn patience(secs: u64) -> Duration {
    let emulated = std::env::var_os(EMULATED).is_some_and(|v| v == "1");
    Duration::from_secs(if emulated { secs * 4 } else { secs })
}

/// The file entry for `path` in an exported profile.
pub fn file_entry<'a>(profile: &'a Value, path: &Path) -> Option<&'a Value> {
    let path = path.to_str().unwrap();
    profile["files"]
        .as_array()?
        .iter()
        .find(|f| f["path"] == path)
}

/// The directories an exported profile says changed.
pub fn mutated_dirs(profile: &Value) -> Vec<&str> {
    profile["dirs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| d["mutated"] == true)
        .filter_map(|d| d["path"].as_str())
        .collect()
}

/// The lookup count of `path` in an exported profile's missing names.
pub fn missing_lookups(profile: &Value, path: &Path) -> Option<u64> {
    let path = path.to_str().unwrap();
    profile["missing"]
        .as_array()?
        .iter()
        .find(|m| m["path"] == path)
        .map(|m| m["lookups"].as_u64().unwrap())
}

/// Whether the running kernel's BTF names `name` (a function, a type), read apart from
/// the daemon's own probes.
pub fn kernel_btf_names(name: &str) -> bool {
    let btf = fs::read("/sys/kernel/btf/vmlinux").expect("the kernel's BTF");
    let needle = [name.as_bytes(), b"\0"].concat();
    btf.windows(needle.len()).any(|w| w == needle.as_slice())
}

/// The name of loaded BPF program `id` (at most 15 bytes), from the kernel.
fn program_name(id: u32) -> std::io::Result<String> {
    const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    // struct bpf_prog_info up to its name (offset 64, 16 bytes).
    const INFO_LEN: usize = 80;
    let bpf = |cmd: libc::c_long, attr: &mut [u64; 2]| {
        // SAFETY: `attr` is a zeroed union bpf_attr prefix the command reads.
        let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 16usize) };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r as i32)
        }
    };
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut [u64::from(id), 0])?;
    // SAFETY: a descriptor the kernel just gave this process.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut info = [0u8; INFO_LEN];
    let mut attr = [
        u64::from(fd.as_raw_fd() as u32) | ((INFO_LEN as u64) << 32),
        info.as_mut_ptr() as u64,
    ];
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let name = &info[64..];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Reads a whole file, returning its length.
pub fn read_all(path: &Path) -> usize {
    let mut buf = Vec::new();
    fs::File::open(path)
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
        .read_to_end(&mut buf)
        .unwrap();
    buf.len()
}

/// An unprivileged user for the tests (created once): (uid, gid).
pub fn test_user() -> (u32, u32) {
    const NAME: &str = "hocus-test";
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, NAME]).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().parse().ok())?
    };
    if id("-u").is_none() {
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                NAME,
            ])
            .output()
            .expect("useradd (package passwd)");
        assert!(
            out.status.success() || id("-u").is_some(),
            "useradd {NAME} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (id("-u").unwrap(), id("-g").unwrap())
}

/// JAX for the CPU, and filelock, which JAX needs to keep a cache's size: the jax suite's
/// and the imports benchmark's (one directory for both).
pub fn jax_packages() -> PathBuf {
    python_packages("jax-0.10.2", &["jax[cpu]==0.10.2", "filelock==3.20.0"])
}

/// numpy and h5py from PyPI, in a directory of their own (`python_packages`).
pub fn numpy_h5py() -> PathBuf {
    python_packages("numpy-h5py", &["numpy==2.2.6", "h5py==3.13.0"])
}

/// An HDF5 file of 64 MiB made with h5py (from `packages`): a contiguous float32
/// dataset `x` of 1024 rows of 16384, row r holding r * 16384 .. (r + 1) * 16384. Its
/// bytes, and where the dataset starts in them.
pub fn hdf5_rows(packages: &Path) -> (Vec<u8>, u64) {
    let work = tempfile::tempdir().unwrap();
    let made = work.path().join("rows.h5");
    let out = Command::new("python3")
        .env("PYTHONPATH", packages)
        .arg("-c")
        .arg(format!(
            "import h5py, numpy as np\n\
             with h5py.File('{}', 'w') as f:\n    \
             d = f.create_dataset('x', data=np.arange(1024 * 16384, dtype=np.float32).reshape(1024, 16384))\n    \
             print(d.id.get_offset())",
            made.display()
        ))
        .output()
        .unwrap();
    assert_success(&out);
    let offset = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    (fs::read(&made).unwrap(), offset)
}

/// Where `python_packages` installs.
const PACKAGES: &str = "/opt/hocus-tests";

/// Python packages installed with pip into a directory of their own (world-readable, so
/// ordinary users' jobs can import them), once per machine: e.g. `["jax[cpu]==0.10.2"]`.
/// In /opt, which the rig's guests see as the machine has it (they have no network to
/// install from, and a /var/cache of their own). Fails loudly when pip cannot install
/// them.
pub fn python_packages(name: &str, specs: &[&str]) -> PathBuf {
    // One at a time in a process (a whole run installs the guests' and the benchmarks'
    // side by side): the `chmod -R` below walks what another pip is still writing.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = PathBuf::from(PACKAGES).join(name);
    let done = dir.join(".installed");
    let wanted = specs.join(" ");
    if fs::read_to_string(&done).is_ok_and(|had| had == wanted) {
        return dir;
    }
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-warn-script-location",
            // Into a directory of its own, never the system's Python: Debian's
            // "externally managed" guard need not stop it.
            "--break-system-packages",
            "--target",
        ])
        .arg(&dir)
        .args(specs));
    run(Command::new("chmod").args(["-R", "a+rX"]).arg(PACKAGES));
    fs::write(&done, wanted).unwrap();
    dir
}

/// Sample names on a metrics page (classic text format).
pub fn sample_names(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// Every `hocus_...` name in a text.
pub fn names_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("hocus_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// `cmd` run to its end within `secs` (`patience`), or killed and the test failed,
/// saying so.
pub fn finished_within(
    cmd: &mut std::process::Command,
    secs: u64,
    what: &str,
) -> std::process::Output {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let bound = patience(secs);
    let deadline = std::time::Instant::now() + bound;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish in {} s: {}",
                bound.as_secs(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().unwrap()
}

/// A profile naming `files` (entries as a profile holds them), written in `dir` for any
/// user to read.
pub fn profile_in(dir: &Path, name: &str, files: Vec<Value>) -> PathBuf {
    let profile =
        json!({"version": 2, "started_unix_ns": 1, "missing": [], "dirs": [], "files": files});
    let file = dir.join(name);
    fs::write(&file, serde_json::to_vec(&profile).unwrap()).unwrap();
    fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
    file
}
