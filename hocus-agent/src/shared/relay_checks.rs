//! What a child of a multi-node job asks its parent besides files (issue 52): to vouch
//! for its job start's checks, and for its verdicts of what the job's user may read.
//! Both are read after the connection is proven, like a transfer (`relay`).
//!
//! A child may also ask its parent to vouch for its job start's checks (issue 52:
//! the server is asked once for all of a job's nodes): the length word's second bit
//! set and the rest counting the paths, the time allowed, then each network path its
//! copies expect (a copied file, each entry of a snapshot) and the digest of the
//! identity expected there (`redirect::vouch::digest`); the parent answers `VOUCHED`
//! and, for each, how long ago its own check of a copy expecting the same there against
//! the server began, or [`NOT_VOUCHED`]. A daemon before this one
//! refuses the request (a path too long), and the child checks the server itself.
//!
//! And for its verdicts of what the job's user may read of the job's profile (the
//! prolog's check as the user, once for all of a job's nodes): the length word's third
//! bit set and the rest counting the entries, the time allowed, the user (uid, gid,
//! groups), then each entry's kind and path ([`request_verdicts`]); the parent answers
//! `VERDICTS` and, for each, whether the user may read it and how long ago its own check
//! began, or [`NOT_VOUCHED`] where it has no verdict for that user.

use std::{
    io::{self, Read},
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    time::Duration,
};

/// The BLAKE3 hash of a file's bytes.
pub type Hash = [u8; 32];
/// The longest path asked for.
pub const MAX_PATH: usize = 4096;
/// A parent's answers: checks vouched for, verdicts given (after the relay's `FILE`,
/// `NOT_HELD`, `WAIT` and `RANGES`).
pub const VOUCHED: u8 = 4;
pub const VERDICTS: u8 = 5;

/// Set in a request's length word: a job start's paths to vouch for follow, as many as
/// the rest of the word says ([`request_vouch`]).
pub(super) const VOUCH: u32 = 1 << 30;
/// Set in a request's length word: entries of the job's profile follow, as many as the
/// rest of the word says, for the parent's verdicts of what the job's user may read
/// ([`request_verdicts`]).
pub(super) const VERDICTS_OF: u32 = 1 << 29;
/// The most groups a user asked about has (Linux's NGROUPS_MAX).
pub(super) const MAX_GROUPS: usize = 65_536;
/// A verdict's answer: the user may read the entry (else may not); the rest of the word
/// is how long ago (ms) its check began.
pub const MAY_READ: u32 = 1 << 31;
/// The most paths one request asks to be vouched for.
pub const MAX_VOUCHED: usize = 1 << 16;
/// The most bytes of paths one such request holds: what a parent reads of it at most.
pub(super) const MAX_VOUCHED_PATHS: usize = 16 << 20;
/// A bind's answer when it is not vouched for: the asking node checks it itself.
pub const NOT_VOUCHED: u32 = u32::MAX;
/// A request that the job-start checks of `items` (each a network path and the digest
/// of the identity a copy expects there) be vouched for, answered within
/// `allowed`, encoded: the length word flagged and counting the items, the time allowed
/// in ms (u32), then each item's path (u32 length, bytes) and digest (32 bytes).
pub fn request_vouch(allowed: Duration, items: &[(&Path, Hash)]) -> Vec<u8> {
    let items = &items[..items.len().min(MAX_VOUCHED)];
    let mut out = (items.len() as u32 | VOUCH).to_be_bytes().to_vec();
    out.extend((allowed.as_millis().min(u128::from(u32::MAX)) as u32).to_be_bytes());
    for (path, digest) in items {
        let bytes = path.as_os_str().as_bytes();
        out.extend((bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(bytes);
        out.extend_from_slice(digest);
    }
    out
}

/// The answer to a [`request_vouch`]: `VOUCHED`, then for each item in its order how
/// long ago (ms) its check against the server began, or [`NOT_VOUCHED`].
pub fn answer_vouch(ages: &[u32]) -> Vec<u8> {
    let mut out = vec![VOUCHED];
    for age in ages {
        out.extend(age.to_be_bytes());
    }
    out
}

/// What a profile's entry is, for the check of who may read it (`redirect::access`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Entry {
    /// A file: readable, or gone from a directory they may search.
    File = 0,
    /// A directory: readable and searchable.
    Dir = 1,
    /// A missing name: its directory searchable.
    Missing = 2,
}

/// A parent's verdict of an entry: whether the user may read it, and how long ago its
/// check began; None where it has none.
pub type Verdict = Option<(bool, Duration)>;

/// The user a job runs as, as both nodes know it from Slurm: uid, gid, groups (sorted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobUser {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// A request for the parent's verdicts of what `user` may read of `items` (entries of
/// the job's profile), answered within `allowed`, encoded: the length word flagged and
/// counting the items, the time allowed in ms, the uid, the gid, the groups (a count,
/// then each), then each item's kind (a byte) and path (u32 length, bytes); u32s all.
pub fn request_verdicts(allowed: Duration, user: &JobUser, items: &[(Entry, &str)]) -> Vec<u8> {
    let items = &items[..items.len().min(MAX_VOUCHED)];
    let groups = &user.groups[..user.groups.len().min(MAX_GROUPS)];
    let mut out = (items.len() as u32 | VERDICTS_OF).to_be_bytes().to_vec();
    out.extend((allowed.as_millis().min(u128::from(u32::MAX)) as u32).to_be_bytes());
    out.extend(user.uid.to_be_bytes());
    out.extend(user.gid.to_be_bytes());
    out.extend((groups.len() as u32).to_be_bytes());
    for g in groups {
        out.extend(g.to_be_bytes());
    }
    for (kind, path) in items {
        out.push(*kind as u8);
        out.extend((path.len() as u32).to_be_bytes());
        out.extend_from_slice(path.as_bytes());
    }
    out
}

/// Entries whose verdicts a child asks its parent for: what the job's user may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerdictsOf {
    pub allowed: Duration,
    pub user: JobUser,
    pub items: Vec<(Entry, String)>,
}

/// The rest of a [`request_verdicts`] of `count` items.
pub(super) fn read_verdicts_of(r: &mut impl Read, count: usize) -> io::Result<VerdictsOf> {
    if count > MAX_VOUCHED {
        return Err(io::Error::other("too many entries to give verdicts of"));
    }
    let mut word = || -> io::Result<u32> {
        let mut w = [0u8; 4];
        r.read_exact(&mut w)?;
        Ok(u32::from_be_bytes(w))
    };
    let allowed = Duration::from_millis(u64::from(word()?));
    let (uid, gid, n) = (word()?, word()?, word()? as usize);
    if n > MAX_GROUPS {
        return Err(io::Error::other("too many groups"));
    }
    let groups = (0..n).map(|_| word()).collect::<io::Result<Vec<u32>>>()?;
    let (mut items, mut bytes) = (Vec::with_capacity(count), 0);
    for _ in 0..count {
        let mut kind = [0u8; 1];
        r.read_exact(&mut kind)?;
        let kind = match kind[0] {
            0 => Entry::File,
            1 => Entry::Dir,
            2 => Entry::Missing,
            other => return Err(io::Error::other(format!("an entry of kind {other}"))),
        };
        items.push((kind, read_counted_path(r, &mut bytes)?));
    }
    Ok(VerdictsOf {
        allowed,
        user: JobUser { uid, gid, groups },
        items,
    })
}

/// The answer to a [`request_verdicts`]: `VERDICTS`, then for each item in its order
/// [`MAY_READ`] or not with how long ago (ms) its check began, or [`NOT_VOUCHED`].
pub fn answer_verdicts(verdicts: &[Verdict]) -> Vec<u8> {
    let mut out = vec![VERDICTS];
    for v in verdicts {
        let word = v.map_or(NOT_VOUCHED, |(may, age)| {
            let ms = age.as_millis().min(u128::from(MAY_READ - 2)) as u32;
            if may { MAY_READ | ms } else { ms }
        });
        out.extend(word.to_be_bytes());
    }
    out
}

/// The verdicts of an [`answer_verdicts`] (its status read already) for `count` items.
pub fn read_verdicts(r: &mut impl Read, count: usize) -> io::Result<Vec<Verdict>> {
    Ok(read_ages(r, count)?
        .into_iter()
        .map(|w| {
            (w != NOT_VOUCHED).then(|| {
                (
                    w & MAY_READ != 0,
                    Duration::from_millis(u64::from(w & !MAY_READ)),
                )
            })
        })
        .collect())
}

/// Paths whose job-start checks a child asks its parent to vouch for: each a network
/// path and the digest of the identity the child's copy expects there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vouch {
    pub allowed: Duration,
    pub items: Vec<(PathBuf, Hash)>,
}

/// The rest of a [`request_vouch`] of `count` items.
pub(super) fn read_vouch(r: &mut impl Read, count: usize) -> io::Result<Vouch> {
    if count > MAX_VOUCHED {
        return Err(io::Error::other("too many paths to vouch for"));
    }
    let mut word = [0u8; 4];
    r.read_exact(&mut word)?;
    let allowed = Duration::from_millis(u64::from(u32::from_be_bytes(word)));
    let (mut items, mut bytes) = (Vec::with_capacity(count), 0);
    for _ in 0..count {
        let path = read_counted_path(r, &mut bytes)?;
        let mut digest = [0u8; 32];
        r.read_exact(&mut digest)?;
        items.push((PathBuf::from(path), digest));
    }
    Ok(Vouch { allowed, items })
}

/// A path (u32 length, bytes), its bytes added to `bytes`: a request holds at most
/// [`MAX_VOUCHED_PATHS`] of them.
fn read_counted_path(r: &mut impl Read, bytes: &mut usize) -> io::Result<String> {
    let mut word = [0u8; 4];
    r.read_exact(&mut word)?;
    let len = u32::from_be_bytes(word) as usize;
    *bytes += len;
    if *bytes > MAX_VOUCHED_PATHS {
        return Err(io::Error::other("too many bytes of paths in one request"));
    }
    read_path(r, len)
}

/// The ages of a [`answer_vouch`] (its status read already) for `count` items.
pub fn read_ages(r: &mut impl Read, count: usize) -> io::Result<Vec<u32>> {
    let mut ages = vec![0u8; count * 4];
    r.read_exact(&mut ages)?;
    Ok(ages
        .chunks(4)
        .map(|w| u32::from_be_bytes(w.try_into().expect("4 bytes")))
        .collect())
}

/// A path of `len` bytes (at most [`MAX_PATH`]).
pub(super) fn read_path(r: &mut impl Read, len: usize) -> io::Result<String> {
    if len == 0 || len > MAX_PATH {
        return Err(io::Error::other("a path of no or too many bytes"));
    }
    let mut path = vec![0u8; len];
    r.read_exact(&mut path)?;
    String::from_utf8(path).map_err(io::Error::other)
}
