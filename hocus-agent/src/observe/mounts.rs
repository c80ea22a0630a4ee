//! The mount table (/proc/self/mountinfo): which mounts are network filesystems, and
//! which mount a path lives on.

use std::{
    fs,
    os::fd::{AsRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub id: u32,
    pub parent: u32,
    pub major: u32,
    pub minor: u32,
    /// The directory of the filesystem that is mounted here.
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub source: String,
    /// Filesystem-specific options (for a cgroup v1 hierarchy: its controllers).
    pub super_options: String,
}

/// Filesystem types whose data lives on another machine.
const NETWORK_TYPES: &[&str] = &[
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "lustre",
    "gpfs",
    "beegfs",
    "ceph",
    "9p",
    "afs",
    "glusterfs",
    "ocfs2",
    "gfs2",
    "pvfs2",
    "orangefs",
    "panfs",
    "wekafs",
    "virtiofs",
];

/// FUSE subtypes (`fuse.<subtype>`) that are network filesystems.
const NETWORK_FUSE_TYPES: &[&str] = &[
    "sshfs",
    "glusterfs",
    "ceph-fuse",
    "cephfs",
    "s3fs",
    "rclone",
    "gcsfuse",
    "juicefs",
    "beegfs",
    "lustre",
    "cvmfs2",
    "cvmfs",
    "goofys",
    "davfs",
    "davfs2",
    "curlftpfs",
    "blobfuse",
    "blobfuse2",
    "mountpoint-s3",
    "lizardfs",
    "moosefs",
    "mfs",
    "seaweedfs",
    "alluxio-fuse",
    "xtreemfs",
    "gvfsd-fuse",
];

impl Mount {
    pub fn is_network(&self) -> bool {
        is_network_type(&self.fs_type)
    }

    /// The longest an NFS mount's client trusts the attributes it cached (the least of
    /// its `acregmax` and `acdirmax`); None where it says none (not NFS).
    pub fn attribute_cache_max(&self) -> Option<std::time::Duration> {
        if !self.fs_type.starts_with("nfs") {
            return None;
        }
        self.super_options
            .split(',')
            .filter_map(|o| {
                let (k, v) = o.split_once('=')?;
                matches!(k, "acregmax" | "acdirmax").then(|| v.parse::<u64>().ok())?
            })
            .min()
            .map(std::time::Duration::from_secs)
    }
}

/// Whether a filesystem is FUSE: every lookup it does not hold (a failed one always) and
/// every open is a request to its server, which the tripwire sees.
pub fn is_fuse_type(fs_type: &str) -> bool {
    fs_type == "fuse" || fs_type == "fuseblk" || fs_type.starts_with("fuse.")
}

pub fn is_network_type(fs_type: &str) -> bool {
    if let Some(sub) = fs_type.strip_prefix("fuse.") {
        return NETWORK_FUSE_TYPES.contains(&sub);
    }
    NETWORK_TYPES.contains(&fs_type)
}

/// Reads this process's mount table.
pub fn read() -> Result<Vec<Mount>> {
    let text =
        fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    parse(&text).context("parsing /proc/self/mountinfo")
}

/// Parses mountinfo text (proc(5)): `36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw`.
pub fn parse(text: &str) -> Result<Vec<Mount>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| parse_line(line).with_context(|| format!("malformed line: {line:?}")))
        .collect()
}

fn parse_line(line: &str) -> Result<Mount> {
    let (before, after) = line
        .split_once(" - ")
        .context("no ' - ' separator before the filesystem type")?;
    let mut f = before.split(' ');
    let mut next = |what: &str| f.next().with_context(|| format!("missing {what}"));
    let id = next("mount id")?.parse()?;
    let parent = next("parent id")?.parse()?;
    let (major, minor) = next("device")?
        .split_once(':')
        .context("device is not major:minor")?;
    let root = unescape(next("root")?);
    let mount_point = unescape(next("mount point")?);
    let mut a = after.split(' ');
    let fs_type = a
        .next()
        .filter(|t| !t.is_empty())
        .context("missing filesystem type")?;
    let source = unescape(a.next().unwrap_or_default());
    let super_options = a.next().unwrap_or_default();
    let root = nfs_root(fs_type, &source).unwrap_or(root);
    Ok(Mount {
        id,
        parent,
        major: major.parse()?,
        minor: minor.parse()?,
        root: PathBuf::from(root),
        mount_point: PathBuf::from(mount_point),
        fs_type: fs_type.to_owned(),
        source,
        super_options: super_options.to_owned(),
    })
}

/// Kernel NFS shows every mount's root as `/` (its `show_path`), and the directory
/// mounted in the source instead (`server:/export/env/pkg` for a bind of `env/pkg` of a
/// mount of `server:/export`): the root, for the paths below each mount to compare.
fn nfs_root(fs_type: &str, source: &str) -> Option<String> {
    if !matches!(fs_type, "nfs" | "nfs4") {
        return None;
    }
    // `host:/path`, `[v6 address]:/path`.
    let after_host = match source.strip_prefix('[') {
        Some(rest) => rest.split_once("]:")?.1,
        None => source.split_once(':')?.1,
    };
    after_host.starts_with('/').then(|| after_host.to_owned())
}

/// Undoes the octal escapes mountinfo uses for space, tab, newline and backslash.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let digit = |b: u8| u32::from(b - b'0');
            let v = digit(bytes[i + 1]) * 64 + digit(bytes[i + 2]) * 8 + digit(bytes[i + 3]);
            out.push(v as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount `path` lives on: the last-mounted one with the longest matching mount point.
pub fn mount_of<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    mounts
        .iter()
        .enumerate()
        .filter(|(_, m)| path.starts_with(&m.mount_point))
        .max_by_key(|(i, m)| (m.mount_point.as_os_str().len(), *i))
        .map(|(_, m)| m)
}

/// Each NFS mount's own count of the operations its client sent, from
/// /proc/self/mountstats (its "per-op statistics": the first figure of each is the
/// requests sent), by mount point; operations never sent are left out.
pub fn nfs_operations() -> Vec<(PathBuf, Vec<(String, u64)>)> {
    fs::read_to_string("/proc/self/mountstats")
        .map(|t| parse_nfs_operations(&t))
        .unwrap_or_default()
}

pub fn parse_nfs_operations(text: &str) -> Vec<(PathBuf, Vec<(String, u64)>)> {
    let mut out: Vec<(PathBuf, Vec<(String, u64)>)> = Vec::new();
    let mut in_ops = false;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("device ") {
            in_ops = false;
            let point = rest
                .split_once(" mounted on ")
                .and_then(|(_, r)| r.rsplit_once(" with fstype "))
                .filter(|(_, t)| t.starts_with("nfs"));
            if let Some((point, _)) = point {
                out.push((PathBuf::from(unescape(point)), Vec::new()));
            }
            continue;
        }
        let Some((_, ops)) = out.last_mut() else {
            continue;
        };
        let line = line.trim();
        if line == "per-op statistics" {
            in_ops = true;
        } else if in_ops {
            let counted = line
                .split_once(':')
                .and_then(|(op, r)| Some((op, r.split_whitespace().next()?.parse().ok()?)));
            match counted {
                Some((op, n)) if n > 0 => ops.push((op.to_owned(), n)),
                Some(_) => {}
                None => in_ops = false,
            }
        }
    }
    out
}

/// The network mounts to watch when the user names none, outermost first, without
/// mounts nested inside another chosen one.
pub fn default_watches(mounts: &[Mount]) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = mounts
        .iter()
        // A diskless node's root on the network is not a tree to watch (`/` never is):
        // the network mounts below it are.
        .filter(|m| m.is_network() && m.mount_point != Path::new("/"))
        .map(|m| m.mount_point.clone())
        .collect();
    points.sort_by_key(|p| p.as_os_str().len());
    let mut chosen: Vec<PathBuf> = Vec::new();
    for p in points {
        if !chosen.iter().any(|c| p.starts_with(c)) {
            chosen.push(p);
        }
    }
    chosen
}

/// A descriptor of directory `path` (canonical: refused if it goes through a symlink
/// now), held as the tree it is.
pub fn open_dir(path: &Path) -> Result<OwnedFd> {
    crate::shared::dirs::open_dir(path).with_context(|| format!("opening {}", path.display()))
}

/// The metadata of what a descriptor names.
pub fn metadata_of(fd: &OwnedFd) -> std::io::Result<fs::Metadata> {
    fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Checks that a path to watch exists and is a directory, and returns its canonical form.
pub fn check_watch(path: &Path) -> Result<PathBuf> {
    let canonical = fs::canonicalize(path).with_context(|| {
        format!(
            "cannot watch {}: it does not exist or is not reachable",
            path.display()
        )
    })?;
    if !canonical.is_dir() {
        bail!("cannot watch {}: it is not a directory", path.display());
    }
    if canonical == Path::new("/") {
        bail!("refusing to watch / : name the network mounts to watch (e.g. --watch /home)");
    }
    Ok(canonical)
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_nfs_mounts_attribute_cache_max_is_its_lesser_acregmax_or_acdirmax() {
        let text = "40 22 0:35 / /home rw,relatime - nfs4 server:/export/home rw,vers=4.2,acregmin=3,acregmax=60,acdirmin=30,acdirmax=45
41 22 0:36 / /scratch rw - nfs server:/scratch rw,vers=3
50 22 0:40 / /mnt/net rw - fuse.sshfs root@h:/srv rw,user_id=0
";
        let m = parse(text).unwrap();
        assert_eq!(
            m[0].attribute_cache_max(),
            Some(std::time::Duration::from_secs(45))
        );
        assert_eq!(m[1].attribute_cache_max(), None);
        assert_eq!(m[2].attribute_cache_max(), None);
    }

    #[test]
    fn nfs_operations_are_read_from_mountstats_per_mount() {
        let text = "device proc mounted on /proc with fstype proc
device 10.0.0.1:/home mounted on /net/my\\040home with fstype nfs4 statvers=1.1
\topts:\trw,vers=4.2
\tper-op statistics
\t        NULL: 0 0 0 0 0 0 0 0
\t        READ: 12 12 0 1440 4096 3 5 9 0
\t     GETATTR: 7 7 0 980 1500 1 2 3 0

device srv:/scratch mounted on /scratch with fstype nfs statvers=1.1
\tper-op statistics
\t      LOOKUP: 3 3 0 1 1 1 1 1 0
device tmpfs mounted on /tmp with fstype tmpfs
";
        let got = parse_nfs_operations(text);
        assert_eq!(
            got,
            vec![
                (
                    PathBuf::from("/net/my home"),
                    vec![("READ".into(), 12), ("GETATTR".into(), 7)]
                ),
                (PathBuf::from("/scratch"), vec![("LOOKUP".into(), 3)]),
            ]
        );
    }

    use super::*;

    const SAMPLE: &str = "\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:2 - proc proc rw
40 22 0:35 / /home rw,relatime shared:20 - nfs4 server:/export/home rw,vers=4.2
41 40 0:36 / /home/alice/scratch rw,relatime shared:21 - lustre 10.0.0.1@tcp:/scratch rw
50 22 0:40 /srv/export /mnt/net\\040share rw,nosuid,nodev,relatime shared:30 - fuse.sshfs root@127.0.0.1:/srv/export rw,user_id=0,group_id=0,allow_other
51 22 0:41 / /mnt/local-fuse rw,nosuid shared:31 - fuse.squashfuse squashfuse rw
52 22 0:42 / /data rw master:4 propagate_from:2 unbindable - cifs //nas/data rw
";

    #[test]
    fn parses_fields_and_escapes() {
        let m = parse(SAMPLE).unwrap();
        assert_eq!(m.len(), 7);
        assert_eq!(m[2].fs_type, "nfs4");
        assert_eq!(m[2].source, "server:/export/home");
        assert_eq!((m[2].major, m[2].minor), (0, 35));
        assert_eq!(m[4].mount_point, PathBuf::from("/mnt/net share"));
        assert_eq!(m[4].root, PathBuf::from("/srv/export"));
        // optional fields of any number before the separator
        assert_eq!(m[6].fs_type, "cifs");
        assert_eq!(m[6].parent, 22);
    }

    #[test]
    fn an_nfs_mount_s_root_is_the_directory_its_source_names() {
        let binds = "\
60 22 0:35 / /srv rw,relatime - nfs4 server:/export/home/alice/env rw,vers=4.2
61 22 0:37 / /opt/sw rw,relatime - nfs [fd00::1]:/sw rw,vers=3
";
        let m = parse(&format!("{SAMPLE}{binds}")).unwrap();
        // A bind of a subdirectory of the /home mount: the same superblock, a root
        // below the other's.
        assert_eq!(m[2].root, PathBuf::from("/export/home"));
        assert_eq!(m[7].root, PathBuf::from("/export/home/alice/env"));
        assert_eq!(m[8].root, PathBuf::from("/sw"));
        // Not NFS: as the kernel shows it.
        assert_eq!(m[3].root, PathBuf::from("/"));
    }

    #[test]
    fn knows_network_filesystems() {
        let m = parse(SAMPLE).unwrap();
        let net: Vec<_> = m
            .iter()
            .filter(|m| m.is_network())
            .map(|m| m.fs_type.as_str())
            .collect();
        assert_eq!(net, ["nfs4", "lustre", "fuse.sshfs", "cifs"]);
        assert!(!is_network_type("fuse"));
        assert!(!is_network_type("tmpfs"));
    }

    #[test]
    fn knows_fuse_filesystems() {
        for fuse in ["fuse", "fuseblk", "fuse.sshfs", "fuse.gcsfuse"] {
            assert!(is_fuse_type(fuse), "{fuse}");
        }
        for other in ["nfs4", "lustre", "tmpfs", "ext4", "fusectl"] {
            assert!(!is_fuse_type(other), "{other}");
        }
    }

    #[test]
    fn default_watches_skip_nested_mounts() {
        let m = parse(SAMPLE).unwrap();
        assert_eq!(
            default_watches(&m),
            ["/home", "/data", "/mnt/net share"].map(PathBuf::from)
        );
    }

    #[test]
    fn a_diskless_nodes_root_on_the_network_leaves_the_mounts_below_it() {
        let diskless = SAMPLE.replace(
            "252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
            "0:20 / / rw shared:1 - nfs 10.0.0.1:/roots/node7 rw,vers=3",
        );
        let m = parse(&diskless).unwrap();
        assert_eq!(
            default_watches(&m),
            ["/home", "/data", "/mnt/net share"].map(PathBuf::from)
        );
    }

    #[test]
    fn finds_the_mount_of_a_path() {
        let m = parse(SAMPLE).unwrap();
        let at = |p: &str| mount_of(&m, Path::new(p)).unwrap().mount_point.clone();
        assert_eq!(at("/home/bob/x.py"), PathBuf::from("/home"));
        assert_eq!(
            at("/home/alice/scratch/a"),
            PathBuf::from("/home/alice/scratch")
        );
        assert_eq!(at("/homework"), PathBuf::from("/"));
    }

    #[test]
    fn rejects_malformed_lines() {
        assert!(parse("22 1 252:1 / / rw,relatime shared:1 ext4 /dev/vda rw").is_err());
        assert!(parse("x 1 252:1 / / rw - ext4 /dev/vda rw").is_err());
    }
}
