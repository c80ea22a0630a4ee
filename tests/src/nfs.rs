//! Kernel NFS for the tests: the kernel's own NFS server (nfsd, with rpcbind and mountd
//! from nfs-kernel-server) serving a directory of the test's to 127.0.0.1, and the
//! kernel's NFS client mounting it, v3 or v4.2. This machine's kernel has neither: the
//! tests that use it run in the rig's guests (`cargo xtask vm test --fs nfs3`), which
//! boot Debian's stock kernels.

use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Mutex, OnceLock,
        atomic::{AtomicU32, Ordering},
    },
};

use crate::run;

/// The NFS versions the tests mount with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V3,
    V4,
}

impl Version {
    fn option(self) -> &'static str {
        match self {
            Self::V3 => "vers=3,nolock",
            Self::V4 => "vers=4.2",
        }
    }
}

/// Which filesystem the tests' network mounts are: sshfs unless `HOCUS_TEST_FS` says
/// `nfs3` or `nfs4`.
pub fn from_env() -> Option<Version> {
    match std::env::var("HOCUS_TEST_FS").as_deref() {
        Ok("nfs3") => Some(Version::V3),
        Ok("nfs4") => Some(Version::V4),
        Ok("sshfs") | Err(_) => None,
        Ok(other) => panic!("HOCUS_TEST_FS={other}: it takes sshfs, nfs3 or nfs4"),
    }
}

/// Starts the NFS server once per test binary (it lives as long as the guest).
fn server() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        for module in ["nfsd", "nfs", "nfsv3", "nfsv4"] {
            // Built in, or loadable: either way it is there after this.
            let _ = Command::new("modprobe").arg(module).status();
        }
        if !Path::new("/proc/fs/nfsd/threads").exists() {
            run(Command::new("mount").args(["-t", "nfsd", "nfsd", "/proc/fs/nfsd"]));
        }
        for dir in ["/run/rpcbind", "/var/lib/nfs"] {
            fs::create_dir_all(dir).unwrap();
        }
        let running = |name: &str| {
            Command::new("pgrep")
                .args(["-x", name])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if !running("rpcbind") {
            run(Command::new("rpcbind").arg("-w"));
        }
        if !running("rpc.mountd") {
            run(&mut Command::new("rpc.mountd"));
        }
        run(Command::new("rpc.nfsd").arg("8"));
        // NFSv4 sees the exports beneath one root export (fsid=0): every export is bound
        // beneath it.
        fs::create_dir_all(ROOT).unwrap();
        run(Command::new("mount").args(["-t", "tmpfs", "-o", "mode=0755", "hocus-nfs", ROOT]));
        run(Command::new("exportfs")
            .args(["-o", "ro,fsid=0,no_subtree_check,insecure"])
            .arg(format!("127.0.0.1:{ROOT}")));
    });
}

/// The NFSv4 root export, beneath which each export is bound (`exported_as`).
const ROOT: &str = "/run/hocus-nfs";

/// Where the server exports `dir` (bound there by `export_and_mount`): its name below
/// the v4 root.
fn exported_as(dir: &Path) -> String {
    let name: String = dir
        .display()
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    name.trim_matches('_').to_owned()
}

/// How a share is exported and mounted, beyond the version.
#[derive(Clone, Copy, Debug, Default)]
pub struct Share {
    /// The server maps the client's root to nobody (most sites' exports).
    pub root_squash: bool,
    /// More mount options (`actimeo=600`, `noac` ...).
    pub options: &'static str,
}

/// Exports `dir` to 127.0.0.1 and mounts it at `at`. `dir` becomes a tmpfs of its own
/// first: the guests' /tmp (an overlay) cannot be exported.
pub fn export_and_mount(dir: &Path, at: &Path, version: Version, share: Share) {
    server();
    run(Command::new("mount")
        .args(["-t", "tmpfs", "-o", "mode=0755", "hocus-export"])
        .arg(dir));
    let exported = Path::new(ROOT).join(exported_as(dir));
    fs::create_dir_all(&exported).unwrap();
    run(Command::new("mount").arg("--bind").arg(dir).arg(&exported));
    // Every export needs an fsid of its own: a tmpfs has no UUID to tell them apart.
    static NEXT_FSID: AtomicU32 = AtomicU32::new(1);
    let fsid = std::process::id() * 1000 + NEXT_FSID.fetch_add(1, Ordering::Relaxed);
    let squash = if share.root_squash {
        "root_squash"
    } else {
        "no_root_squash"
    };
    run(Command::new("exportfs")
        .arg("-o")
        .arg(format!(
            "rw,sync,{squash},fsid={fsid},no_subtree_check,insecure"
        ))
        .arg(format!("127.0.0.1:{}", exported.display())));
    mount(dir, at, version, share.options);
}

/// The command that mounts the export of `dir` at `at`, with more `options` if not empty.
pub fn mount_command(dir: &Path, at: &Path, version: Version, options: &str) -> Command {
    let name = exported_as(dir);
    let remote = match version {
        Version::V3 => format!("127.0.0.1:{ROOT}/{name}"),
        Version::V4 => format!("127.0.0.1:/{name}"),
    };
    let mut all = version.option().to_owned();
    if !options.is_empty() {
        all = format!("{all},{options}");
    }
    let mut cmd = Command::new("mount");
    cmd.args(["-t", "nfs", "-o", &all]).arg(remote).arg(at);
    cmd
}

/// Mounts the export of `dir` at `at`.
fn mount(dir: &Path, at: &Path, version: Version, options: &str) {
    let out = mount_command(dir, at, version, options)
        .output()
        .expect("running mount");
    if !out.status.success() {
        panic!(
            "mounting {} over NFS failed ({}): {}\n(kernel NFS runs in the rig's guests: cargo xtask vm test --fs nfs3)",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Unexports `dir` (its clients then get errors, as from a server that dropped it).
pub fn unexport(dir: &Path) {
    let exported = Path::new(ROOT).join(exported_as(dir));
    // Quietly: a share whose server was killed is unexported a second time as it goes.
    let _ = Command::new("exportfs")
        .arg("-u")
        .arg(format!("127.0.0.1:{}", exported.display()))
        .output();
}

/// Unexports `dir` and takes its tmpfs away.
pub fn remove(dir: &Path) {
    unexport(dir);
    let exported = Path::new(ROOT).join(exported_as(dir));
    for mounted in [exported.as_path(), dir] {
        let _ = Command::new("umount").arg("-l").arg(mounted).status();
    }
    let _ = fs::remove_dir(&exported);
}

/// The NFS client's tracepoints that stand for requests to the server: a lookup of a name
/// it does not hold (an open's, too) and a read of bytes not cached, on every kernel; a
/// directory listing read from the server, where the kernel has them (6.1 on, not
/// 5.10). What the tests read as the server's log on NFS (`ClientLog`).
const REQUEST_EVENTS: [&str; 2] = ["nfs_lookup_enter", "nfs_initiate_read"];
const LISTING_EVENTS: [&str; 2] = ["nfs_readdir_cache_fill", "nfs_readdir_uncached"];

const TRACEFS: &str = "/sys/kernel/tracing";

/// Starts recording the client's requests (once per test binary): a trace buffer big
/// enough for a test binary's NFS traffic, emptied.
fn record_requests() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let t = Path::new(TRACEFS);
        if !t.join("events").is_dir() {
            run(Command::new("mount").args(["-t", "tracefs", "tracefs", TRACEFS]));
        }
        fs::write(t.join("buffer_size_kb"), "32768").unwrap();
        for event in REQUEST_EVENTS {
            fs::write(t.join("events/nfs").join(event).join("enable"), "1")
                .unwrap_or_else(|e| panic!("enabling nfs:{event}: {e}"));
        }
        for event in LISTING_EVENTS {
            let _ = fs::write(t.join("events/nfs").join(event).join("enable"), "1");
        }
        fs::write(t.join("trace"), "").unwrap();
    });
}

/// What the kernel's NFS client asked the server for one mount, read from its
/// tracepoints (the tests' stand-in for sshfs's SFTP server log), by path on the server:
/// `open "P"` (a lookup made to open P), `lookup "P"`, `opendir "P"`, and
/// `read "P" bytes read N` (an RPC). Files are named by their inode number (NFS's
/// fileid), found on the server side; what was deleted since keeps its number. Lines
/// keep their text once read, so a length marks a point in the log.
pub struct ClientLog {
    /// The mount's device, as the events print it (`00:3c`).
    device: String,
    /// The server's directory, whose inode numbers are the fileids.
    server: PathBuf,
    names: Mutex<HashMap<u64, PathBuf>>,
}

impl ClientLog {
    pub fn start(mount: &Path, server: &Path) -> Self {
        record_requests();
        let dev = fs::metadata(mount).unwrap().dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        Self {
            device: format!("{major:02x}:{minor:02x}"),
            server: server.to_owned(),
            names: Mutex::new(HashMap::new()),
        }
    }

    pub fn text(&self) -> String {
        let trace = fs::read_to_string(Path::new(TRACEFS).join("trace")).unwrap();
        let mut log = String::new();
        for line in trace.lines().filter(|l| !l.starts_with('#')) {
            if let Some(entry) = self.entry(line) {
                log.push_str(&entry);
                log.push('\n');
            }
        }
        log
    }

    fn entry(&self, line: &str) -> Option<String> {
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .map(str::to_owned)
        };
        let (event, _) = line.split_once(": ")?.1.split_once(':')?;
        let file = |id: &str| -> Option<PathBuf> {
            let ino = id.strip_prefix(&self.device)?.strip_prefix(':')?;
            Some(self.path_of(ino.parse().ok()?))
        };
        match event {
            "nfs_lookup_enter" => {
                let name = field("name=")?;
                let (dir, name) = name.split_once('/')?;
                let path = file(dir)?.join(name);
                let what = if line.contains("OPEN") {
                    "open"
                } else {
                    "lookup"
                };
                Some(format!("{what} \"{}\"", path.display()))
            }
            "nfs_initiate_read" => {
                let path = file(&field("fileid=")?)?;
                let count = field("count=")?;
                Some(format!("read \"{}\" bytes read {count}", path.display()))
            }
            "nfs_readdir_cache_fill" | "nfs_readdir_uncached" => {
                let path = file(&field("fileid=")?)?;
                Some(format!("opendir \"{}\"", path.display()))
            }
            _ => None,
        }
    }

    /// The server path of inode `ino`, as first found.
    fn path_of(&self, ino: u64) -> PathBuf {
        let mut names = self.names.lock().unwrap();
        if !names.contains_key(&ino) {
            let mut found = vec![];
            walk(&self.server, &mut found);
            for (i, path) in found {
                names.entry(i).or_insert(path);
            }
        }
        names
            .get(&ino)
            .cloned()
            .unwrap_or_else(|| self.server.join(format!("<inode {ino}>")))
    }
}

fn walk(dir: &Path, found: &mut Vec<(u64, PathBuf)>) {
    found.push((fs::metadata(dir).map_or(0, |m| m.ino()), dir.to_owned()));
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&path, found),
            Ok(_) => found.push((e.metadata().map_or(0, |m| m.ino()), path)),
            Err(_) => {}
        }
    }
}
