//! What the two ends of the relay between a multi-node job's daemons agree on
//! (docs/fanout.md): the tree the job's nodes form (from Slurm's node list, the same on
//! every node), the credential's payload that proves a node, the wire of a transfer, and
//! the hash of a copy's bytes kept with it. The asking end is `cache::relay`, the serving
//! end `control::relay`.
//!
//! A connection opens with a greeting line and a munge credential line; the server
//! answers `OK <credential>` or `NO <why>` and closes. The server's credential proves it
//! in turn ([`proof`]): made by root on the named node, for this job and this child, and
//! bound to the child's own credential, so it cannot be replayed to another child. Any
//! user may listen on the relay's port before the daemon does; without that proof the
//! child takes nothing from it. Then the client asks for files one at a time:
//! the source path (u32 length, bytes); the server answers with one status byte:
//! `FILE` followed by the size (u64), the mtime in ns (i64), the BLAKE3 hash of the bytes
//! (32 bytes) and the bytes; `WAIT` while its own copy is still coming (then another
//! status); `NOT_HELD`. Integers are big-endian.
//!
//! A request may ask for grains of a file instead ([`request_grains`]: the length word's
//! top bit set, then the runs of grains, `u32` start and end each), for a partial copy
//! (docs/partial-copies.md). A server holding a partial copy of that version answers
//! `RANGES`, the size and mtime, then the runs it holds of those asked, each its start
//! and end, the hashes of its grains (32 bytes each, kept as they were filled from the
//! network) and its bytes; a run `0, 0` ends. What it does not hold, the asking node
//! fills from the network.
//!
//! A child may also ask its parent to vouch for its job start's checks, and for its
//! verdicts of what the job's user may read: that wire is `relay_checks`' (re-exported
//! here).
//!
//! Nothing unverified enters a cache: the receiver compares the size and mtime the
//! server offers with what it just read from the network itself, and the bytes with
//! the hash the first node computed as it copied from the network (kept with the copy
//! as an xattr); a short or corrupt transfer is an error and its temporary file is
//! deleted by the copy around it.

use std::{
    ffi::CStr,
    fs::File,
    io::{self, Read},
    os::unix::ffi::OsStrExt,
    path::Path,
    time::Duration,
};

pub use super::relay_checks::*;
use super::relay_checks::{VERDICTS_OF, VOUCH, read_path, read_verdicts_of, read_vouch};
use crate::shared::attrs;

/// The most nodes a job's list may name.
pub const MAX_NODES: usize = 100_000;

/// Version 2: the server proves itself (version 1's children took any `OK`).
pub const GREETING: &str = "HOCUS-RELAY 2";
pub const FILE: u8 = 0;
pub const NOT_HELD: u8 = 1;
pub const WAIT: u8 = 2;
pub const RANGES: u8 = 3;
/// Set in a request's length word: runs of grains follow the path.
const WITH_GRAINS: u32 = 1 << 31;
/// The most runs of grains one request asks for.
pub const MAX_RUNS: usize = 1 << 16;
/// The most grains a run of an answer holds (1 MiB): what a server reads at a time.
pub const RUN_GRAINS: u32 = 16;
/// A run `0, 0` ends an answer's runs.
pub const END_OF_RUNS: [u8; 8] = [0; 8];
/// How often a server says WAIT while its own copy is coming: well within any timeout.
pub const WAIT_EVERY: Duration = Duration::from_millis(500);

/// Where the hash of a copy's bytes is kept, as the first node computed it copying from
/// the network (`trusted.`: only root reads or writes it).
const HASH_XATTR: &CStr = c"trusted.hocus.blake3";

/// What a server offers for a file: its size, mtime and the hash of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    pub size: u64,
    pub mtime_ns: i64,
    pub hash: Hash,
}

impl Offer {
    pub const LEN: usize = 8 + 8 + 32;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.size.to_be_bytes());
        b[8..16].copy_from_slice(&self.mtime_ns.to_be_bytes());
        b[16..].copy_from_slice(&self.hash);
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        Self {
            size: u64::from_be_bytes(b[..8].try_into().expect("8 bytes")),
            mtime_ns: i64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
            hash: b[16..].try_into().expect("32 bytes"),
        }
    }
}

/// A request for a whole file, encoded.
pub fn request(source: &Path) -> Vec<u8> {
    encode(source, None)
}

/// A request for the runs of grains `grains` of a file (at most [`MAX_RUNS`]), encoded.
pub fn request_grains(source: &Path, grains: &[(u32, u32)]) -> Vec<u8> {
    encode(source, Some(&grains[..grains.len().min(MAX_RUNS)]))
}

fn encode(source: &Path, grains: Option<&[(u32, u32)]>) -> Vec<u8> {
    let bytes = source.as_os_str().as_bytes();
    let flag = if grains.is_some() { WITH_GRAINS } else { 0 };
    let mut out = (bytes.len() as u32 | flag).to_be_bytes().to_vec();
    out.extend_from_slice(bytes);
    if let Some(grains) = grains {
        out.extend_from_slice(&(grains.len() as u32).to_be_bytes());
        for &(start, end) in grains {
            out.extend_from_slice(&run(start, end));
        }
    }
    out
}

/// A run of grains `[start, end)`, encoded.
pub fn run(start: u32, end: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&start.to_be_bytes());
    b[4..].copy_from_slice(&end.to_be_bytes());
    b
}

/// Reads a run of grains.
pub fn read_run(r: &mut impl Read) -> io::Result<(u32, u32)> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    let word = |at: usize| u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    Ok((word(0), word(4)))
}

/// What another node asks for: a file, whole or (`grains`) in part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub source: String,
    pub grains: Option<Vec<(u32, u32)>>,
}

/// What another node asks: a file, that its job start's checks be vouched for, or what
/// the job's user may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    File(Request),
    Vouch(Vouch),
    Verdicts(VerdictsOf),
}

/// Reads the next request: None when the asking node closed the connection between
/// requests.
pub fn read_request(r: &mut impl Read) -> io::Result<Option<Asked>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other?,
    }
    let word = u32::from_be_bytes(len);
    if word & VOUCH != 0 && word & WITH_GRAINS == 0 {
        return read_vouch(r, (word & !VOUCH) as usize).map(|v| Some(Asked::Vouch(v)));
    }
    if word & VERDICTS_OF != 0 && word & (WITH_GRAINS | VOUCH) == 0 {
        let count = (word & !VERDICTS_OF) as usize;
        return read_verdicts_of(r, count).map(|v| Some(Asked::Verdicts(v)));
    }
    let len = (word & !WITH_GRAINS) as usize;
    let source = read_path(r, len)?;
    let grains = if word & WITH_GRAINS == 0 {
        None
    } else {
        let mut n = [0u8; 4];
        r.read_exact(&mut n)?;
        let n = u32::from_be_bytes(n) as usize;
        if n > MAX_RUNS {
            return Err(io::Error::other("too many runs of grains"));
        }
        let mut runs = Vec::with_capacity(n);
        for _ in 0..n {
            let (start, end) = read_run(r)?;
            if start >= end {
                return Err(io::Error::other("an empty run of grains"));
            }
            runs.push((start, end));
        }
        Some(runs)
    };
    Ok(Some(Asked::File(Request { source, grains })))
}

/// The hash of one grain's bytes, as a partial copy keeps it.
pub fn grain_hash(bytes: &[u8]) -> Hash {
    *blake3::hash(bytes).as_bytes()
}

/// Records the hash of `file`'s bytes with it (best effort: without it, the hash is
/// computed again when the copy is served).
pub fn keep_hash(file: &File, hash: &Hash) {
    let _ = attrs::set_xattr(file, HASH_XATTR, hash);
}

/// The hash of a copy's bytes: the one kept with it, else computed from them.
pub fn hash_of(file: &File) -> io::Result<Hash> {
    let mut kept = [0u8; 32];
    if attrs::get_xattr(file, HASH_XATTR, &mut kept).ok() == Some(kept.len()) {
        return Ok(kept);
    }
    let mut hasher = blake3::Hasher::new();
    let mut f = file.try_clone()?;
    io::copy(&mut f, &mut hasher)?;
    let hash = *hasher.finalize().as_bytes();
    keep_hash(file, &hash);
    Ok(hash)
}

/// The node whose daemon `nodes[me]` fetches from: its parent in the tree of `width`
/// children per node, rooted at the first node (which reads from the network).
pub fn parent(me: usize, width: usize) -> Option<usize> {
    (me > 0).then(|| (me - 1) / width.max(1))
}

/// The payload of the credential node `from` proves itself to `to` with, for `job`.
pub fn payload(job: u32, from: &str, to: &str) -> String {
    format!("hocus-relay job={job} from={from} to={to}")
}

/// The payload of the credential node `parent` answers `child` with, for `job`: bound to
/// the child's credential `asked` (its hash), which munge accepts once.
pub fn proof(job: u32, parent: &str, child: &str, asked: &str) -> String {
    let bound = blake3::hash(asked.as_bytes()).to_hex();
    format!("hocus-relay-parent job={job} from={parent} to={child} for={bound}")
}

/// The payload of a request from node `from` for the files Slurm job `job` left on node
/// `to`, whose epilog saved its profile there (a later job's; docs/fanout.md).
pub fn held_payload(job: u32, from: &str, to: &str) -> String {
    format!("hocus-relay-held job={job} from={from} to={to}")
}

/// Whether a payload asks for the files a job left on a node (`held_payload`): the node
/// then does not wait for the job's prolog, which will not come.
pub fn is_held(p: &str) -> bool {
    p.starts_with("hocus-relay-held ")
}

/// The job, asking node and named node of a payload.
pub fn parse_payload(p: &str) -> Option<(u32, String, String)> {
    let rest = p
        .strip_prefix("hocus-relay ")
        .or_else(|| p.strip_prefix("hocus-relay-held "))?;
    let mut parts = rest.split(' ');
    let job = parts.next()?.strip_prefix("job=")?.parse().ok()?;
    let from = parts.next()?.strip_prefix("from=")?;
    let to = parts.next()?.strip_prefix("to=")?;
    if parts.next().is_some() || from.is_empty() || to.is_empty() {
        return None;
    }
    Some((job, from.to_owned(), to.to_owned()))
}

/// Slurm's compressed host list (`node[1-3,7],gpu[01-02]x,login`) as names, in order;
/// Err if it is malformed or names more than [`MAX_NODES`].
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in split_top(list) {
        expand_one(item, &mut out)?;
    }
    if out.is_empty() {
        return Err(format!("the node list {list:?} names no node"));
    }
    Ok(out)
}

/// Splits at the commas outside brackets.
fn split_top(list: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

fn expand_one(item: &str, out: &mut Vec<String>) -> Result<(), String> {
    let bad = || format!("the node list entry {item:?} is malformed");
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            return Err(bad());
        }
        out.push(item.to_owned());
        return Ok(());
    };
    let close = open + item[open..].find(']').ok_or_else(bad)?;
    let (prefix, ranges, suffix) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let width = lo.len();
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if a > b || b - a >= MAX_NODES as u64 {
            return Err(bad());
        }
        for n in a..=b {
            // The rest may hold further brackets.
            expand_one(&format!("{prefix}{n:0width$}{suffix}"), out)?;
            if out.len() > MAX_NODES {
                return Err(format!("the node list names more than {MAX_NODES} nodes"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::relay_checks::{MAX_GROUPS, MAX_VOUCHED_PATHS};

    #[test]
    fn an_offer_reads_back() {
        let o = Offer {
            size: 1 << 40,
            mtime_ns: -5,
            hash: [7; 32],
        };
        assert_eq!(Offer::decode(&o.encode()), o);
        assert_eq!(request(Path::new("/a")), vec![0, 0, 0, 2, b'/', b'a']);
        let mut two = request(Path::new("/net/f"));
        two.extend(request(Path::new("/b")));
        two.extend(request_grains(Path::new("/c"), &[(1, 3), (7, 8)]));
        let mut r = &two[..];
        let whole = |s: &str| {
            Some(Asked::File(Request {
                source: s.into(),
                grains: None,
            }))
        };
        assert_eq!(read_request(&mut r).unwrap(), whole("/net/f"));
        assert_eq!(read_request(&mut r).unwrap(), whole("/b"));
        assert_eq!(
            read_request(&mut r).unwrap(),
            Some(Asked::File(Request {
                source: "/c".into(),
                grains: Some(vec![(1, 3), (7, 8)]),
            }))
        );
        assert_eq!(read_request(&mut r).unwrap(), None);
        let mut empty_run = request(Path::new("/c"));
        empty_run[0] |= 0x80;
        empty_run.extend([0, 0, 0, 1, 0, 0, 0, 5, 0, 0, 0, 5]);
        assert!(read_request(&mut &empty_run[..]).is_err(), "an empty run");
        let mut too_many = request(Path::new("/c"));
        too_many[0] |= 0x80;
        too_many.extend((MAX_RUNS as u32 + 1).to_be_bytes());
        assert!(read_request(&mut &too_many[..]).is_err(), "too many runs");
        assert!(
            read_request(&mut &[0u8, 0, 0, 0][..]).is_err(),
            "an empty path"
        );
        assert!(read_request(&mut &[0u8, 1, 0, 0][..]).is_err(), "too long");
    }

    #[test]
    fn a_request_to_vouch_reads_back_and_a_bad_one_does_not() {
        let items = [
            (Path::new("/net/a"), [1; 32]),
            (Path::new("/net/b/c"), [2; 32]),
        ];
        let mut wire = request_vouch(Duration::from_millis(1500), &items);
        wire.extend(request(Path::new("/net/f")));
        let mut r = &wire[..];
        assert_eq!(
            read_request(&mut r).unwrap(),
            Some(Asked::Vouch(Vouch {
                allowed: Duration::from_millis(1500),
                items: items.iter().map(|(p, d)| (p.to_path_buf(), *d)).collect(),
            }))
        );
        assert!(matches!(read_request(&mut r), Ok(Some(Asked::File(_)))));
        let answer = answer_vouch(&[7, NOT_VOUCHED]);
        assert_eq!(answer[0], VOUCHED);
        assert_eq!(read_ages(&mut &answer[1..], 2).unwrap(), [7, NOT_VOUCHED]);
        let mut too_many = ((MAX_VOUCHED as u32 + 1) | VOUCH).to_be_bytes().to_vec();
        too_many.extend([0; 4]);
        assert!(read_request(&mut &too_many[..]).is_err(), "too many items");
        let short = request_vouch(Duration::ZERO, &items);
        assert!(
            read_request(&mut &short[..short.len() - 1]).is_err(),
            "a digest cut short"
        );
        let long = "/x".repeat(MAX_PATH / 2);
        let many = vec![(Path::new(&long), [0; 32]); MAX_VOUCHED_PATHS / MAX_PATH + 1];
        let too_long = request_vouch(Duration::ZERO, &many);
        assert!(read_request(&mut &too_long[..]).is_err(), "too many bytes");
        let mut no_path = request_vouch(Duration::ZERO, &items[..1]);
        no_path[8..12].copy_from_slice(&0u32.to_be_bytes());
        assert!(read_request(&mut &no_path[..]).is_err(), "an empty path");
    }

    #[test]
    fn a_request_for_verdicts_reads_back_and_a_bad_one_does_not() {
        let user = JobUser {
            uid: 1000,
            gid: 100,
            groups: vec![100, 27],
        };
        let items = [
            (Entry::File, "/net/a"),
            (Entry::Missing, "/net/b/__pycache__"),
        ];
        let mut wire = request_verdicts(Duration::from_millis(2000), &user, &items);
        wire.extend(request(Path::new("/net/f")));
        let mut r = &wire[..];
        assert_eq!(
            read_request(&mut r).unwrap(),
            Some(Asked::Verdicts(VerdictsOf {
                allowed: Duration::from_millis(2000),
                user: user.clone(),
                items: items.iter().map(|&(k, p)| (k, p.to_owned())).collect(),
            }))
        );
        assert!(matches!(read_request(&mut r), Ok(Some(Asked::File(_)))));
        let answer = answer_verdicts(&[
            Some((true, Duration::from_millis(5))),
            Some((false, Duration::from_millis(7))),
            None,
        ]);
        assert_eq!(answer[0], VERDICTS);
        assert_eq!(
            read_verdicts(&mut &answer[1..], 3).unwrap(),
            [
                Some((true, Duration::from_millis(5))),
                Some((false, Duration::from_millis(7))),
                None
            ]
        );
        let mut bad_kind = request_verdicts(Duration::ZERO, &user, &items[..1]);
        bad_kind[28] = 9;
        assert!(read_request(&mut &bad_kind[..]).is_err(), "an unknown kind");
        let mut many_groups = request_verdicts(Duration::ZERO, &user, &[]);
        many_groups[16..20].copy_from_slice(&(MAX_GROUPS as u32 + 1).to_be_bytes());
        assert!(
            read_request(&mut &many_groups[..]).is_err(),
            "too many groups"
        );
        let mut too_many = ((MAX_VOUCHED as u32 + 1) | VERDICTS_OF)
            .to_be_bytes()
            .to_vec();
        too_many.extend([0; 16]);
        assert!(
            read_request(&mut &too_many[..]).is_err(),
            "too many entries"
        );
        let short = request_verdicts(Duration::ZERO, &user, &items);
        assert!(
            read_request(&mut &short[..short.len() - 1]).is_err(),
            "a path cut short"
        );
    }

    #[test]
    fn a_hash_is_kept_with_the_copy_or_computed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"bytes").unwrap();
        let f = File::open(&path).unwrap();
        assert_eq!(&hash_of(&f).unwrap(), blake3::hash(b"bytes").as_bytes());
        keep_hash(&f, &[9; 32]);
        // As root (the daemon), the kept one is trusted; others cannot set it.
        if nix::unistd::geteuid().is_root() {
            assert_eq!(hash_of(&f).unwrap(), [9; 32]);
        }
    }

    #[test]
    fn the_tree_has_width_children_per_node() {
        assert_eq!(parent(0, 8), None);
        assert_eq!(
            (1..=8).map(|i| parent(i, 8)).collect::<Vec<_>>(),
            [Some(0); 8]
        );
        assert_eq!(parent(9, 8), Some(1));
        assert_eq!(parent(2, 1), Some(1), "a chain");
    }

    #[test]
    fn slurms_node_lists_expand_in_order() {
        assert_eq!(expand("node[1-3]").unwrap(), ["node1", "node2", "node3"]);
        assert_eq!(
            expand("a[09-11,20],b,c[1-2]x").unwrap(),
            ["a09", "a10", "a11", "a20", "b", "c1x", "c2x"]
        );
        assert_eq!(
            expand("r[1-2]n[1-2]").unwrap(),
            ["r1n1", "r1n2", "r2n1", "r2n2"]
        );
        for bad in ["", "a[", "a]", "a[3-1]", "a[x]", "a[0-99999999]"] {
            assert!(expand(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_proof_names_its_job_both_nodes_and_the_credential_it_answers() {
        let p = proof(42, "node1", "node2", "CRED");
        assert!(p.starts_with("hocus-relay-parent job=42 from=node1 to=node2 for="));
        assert_ne!(p, proof(42, "node1", "node2", "CRED2"));
        assert_ne!(p, proof(43, "node1", "node2", "CRED"));
        assert_ne!(p, proof(42, "node1", "node3", "CRED"));
        // A proof is never a child's payload: one cannot stand for the other.
        assert_eq!(parse_payload(&p), None);
    }

    #[test]
    fn a_payload_reads_back_and_nothing_else_does() {
        let p = payload(42, "node2", "node1");
        assert_eq!(
            parse_payload(&p),
            Some((42, "node2".into(), "node1".into()))
        );
        let held = held_payload(42, "node2", "node1");
        assert_eq!(parse_payload(&held), parse_payload(&p));
        assert!(is_held(&held) && !is_held(&p));
        for bad in [
            "hocus-relay job=x from=a to=b",
            "hocus-relay job=1 from= to=b",
            "hocus-relay job=1 from=a to=b extra",
            "other job=1 from=a to=b",
        ] {
            assert_eq!(parse_payload(bad), None, "{bad}");
        }
    }
}
