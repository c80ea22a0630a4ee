//! The state directory's records: each framed by its length and CRC-32 (a torn or
//! damaged one is found), holding one entry of the working set in a compact binary form.

use std::io::{self, Read};

use crate::profile::format::{DirEntry, Entry, FileEntry, MissingEntry};

pub(super) const END: u8 = 0xff;
const FILE: u8 = 1;
const MISSING: u8 = 2;
const DIR: u8 = 3;

/// Appends a record: its length, its CRC-32, then what `fill` writes.
pub(super) fn frame(buf: &mut Vec<u8>, fill: impl FnOnce(&mut Vec<u8>)) {
    let start = buf.len();
    buf.extend_from_slice(&[0; 8]);
    fill(buf);
    let len = (buf.len() - start - 8) as u32;
    let crc = crc32fast::hash(&buf[start + 8..]);
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Reads the next record into `payload`: false at a clean end; an error for a cut or
/// damaged one.
pub(super) fn read_frame(r: &mut impl Read, payload: &mut Vec<u8>) -> io::Result<bool> {
    let mut head = [0u8; 8];
    match r.read_exact(&mut head[..1]) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(e),
    }
    r.read_exact(&mut head[1..])?;
    let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(head[4..].try_into().expect("4 bytes"));
    // An entry holds a path (at most PATH_MAX) and a few numbers, and its users.
    if len > 1 << 20 {
        return Err(io::Error::other(format!("a record claims {len} bytes")));
    }
    payload.resize(len, 0);
    r.read_exact(payload)?;
    if crc32fast::hash(payload) != crc {
        return Err(io::Error::other("a record's checksum does not match"));
    }
    Ok(true)
}

pub(super) fn encode(b: &mut Vec<u8>, e: &Entry) {
    let path = |b: &mut Vec<u8>, p: &str| {
        b.extend_from_slice(&(p.len() as u32).to_le_bytes());
        b.extend_from_slice(p.as_bytes());
    };
    let u64s = |b: &mut Vec<u8>, xs: &[u64]| {
        xs.iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()))
    };
    match e {
        Entry::File(f) => {
            b.push(FILE);
            path(b, &f.path);
            u64s(
                b,
                &[
                    f.size,
                    f.mtime_ns as u64,
                    f.opens,
                    f.bytes_read,
                    f.first_touch_ns,
                    f.last_touch_ns,
                    f.write_opens,
                ],
            );
            b.push(
                u8::from(f.written)
                    | u8::from(f.refused) << 1
                    | u8::from(f.mapped) << 2
                    | u8::from(f.read_back) << 3,
            );
            b.extend_from_slice(&(f.uids.len() as u32).to_le_bytes());
            f.uids
                .iter()
                .for_each(|u| b.extend_from_slice(&u.to_le_bytes()));
            // Last, so that a record written before ranges were kept reads as none.
            if !f.ranges.is_empty() {
                b.extend_from_slice(&(f.ranges.len() as u32).to_le_bytes());
                f.ranges.iter().for_each(|r| u64s(b, r));
            }
        }
        Entry::Missing(m) => {
            b.push(MISSING);
            path(b, &m.path);
            u64s(b, &[m.lookups, m.first_touch_ns]);
        }
        Entry::Dir(d) => {
            b.push(DIR);
            path(b, &d.path);
            u64s(b, &[d.opens]);
            b.push(u8::from(d.mutated));
        }
    }
}

/// Reads what [`encode`] wrote; None if it is not that.
pub(super) fn decode(b: &[u8]) -> Option<Entry> {
    let mut r = Reader { b, at: 1 };
    let kind = *b.first()?;
    let path = r.path()?;
    let entry = match kind {
        FILE => {
            let [size, mtime, opens, bytes_read, first, last, write_opens] = r.u64s()?;
            let flags = r.u8()?;
            let n = r.u32()? as usize;
            let uids = (0..n.min(r.left() / 4))
                .map(|_| r.u32())
                .collect::<Option<Vec<u32>>>()?;
            let ranges = match r.left() {
                0 => Vec::new(),
                _ => {
                    let n = r.u32()? as usize;
                    (0..n.min(r.left() / 16))
                        .map(|_| r.u64s::<2>())
                        .collect::<Option<Vec<_>>>()?
                }
            };
            Entry::File(FileEntry {
                path,
                size,
                mtime_ns: mtime as i64,
                opens,
                bytes_read,
                first_touch_ns: first,
                last_touch_ns: last,
                users: uids.len() as u32,
                uids,
                written: flags & 1 != 0,
                write_opens,
                refused: flags & 2 != 0,
                mapped: flags & 4 != 0,
                read_back: flags & 8 != 0,
                ranges,
            })
        }
        MISSING => {
            let [lookups, first_touch_ns] = r.u64s()?;
            Entry::Missing(MissingEntry {
                path,
                lookups,
                first_touch_ns,
            })
        }
        DIR => {
            let [opens] = r.u64s()?;
            let mutated = r.u8()? != 0;
            Entry::Dir(DirEntry {
                path,
                opens,
                mutated,
            })
        }
        _ => return None,
    };
    (r.left() == 0).then_some(entry)
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn left(&self) -> usize {
        self.b.len() - self.at
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64s<const N: usize>(&mut self) -> Option<[u64; N]> {
        let mut out = [0; N];
        for x in &mut out {
            *x = u64::from_le_bytes(self.take(8)?.try_into().ok()?);
        }
        Some(out)
    }
    fn path(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        let p = String::from_utf8(self.take(n)?.to_vec()).ok()?;
        // What hocus wrote passed these checks; anything else is damage.
        crate::profile::format::refuse_path(&p, &[std::path::PathBuf::from("/")])
            .is_none()
            .then_some(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_entry_comes_back_and_a_damaged_frame_is_found() {
        let entries = [
            Entry::File(FileEntry {
                path: "/net/a.py".into(),
                size: 1,
                mtime_ns: -2,
                opens: 3,
                bytes_read: 4,
                first_touch_ns: 5,
                last_touch_ns: 6,
                users: 2,
                uids: vec![1000, 1001],
                written: true,
                write_opens: 7,
                refused: true,
                mapped: true,
                read_back: true,
                ranges: vec![[0, 65536], [1 << 20, 3 << 20]],
            }),
            Entry::File(FileEntry {
                path: "/net/b.py".into(),
                ..Default::default()
            }),
            Entry::Missing(MissingEntry {
                path: "/net/nope".into(),
                lookups: 8,
                first_touch_ns: 9,
            }),
            Entry::Dir(DirEntry {
                path: "/net".into(),
                opens: 10,
                mutated: true,
            }),
        ];
        let mut buf = Vec::new();
        for e in &entries {
            frame(&mut buf, |b| encode(b, e));
        }
        let (mut r, mut payload) = (&buf[..], Vec::new());
        for e in &entries {
            assert!(read_frame(&mut r, &mut payload).unwrap());
            assert_eq!(decode(&payload).as_ref(), Some(e));
        }
        assert!(!read_frame(&mut r, &mut payload).unwrap(), "a clean end");
        let last = buf.len() - 1;
        buf[last] ^= 1;
        let mut r = &buf[..];
        for _ in 0..entries.len() - 1 {
            read_frame(&mut r, &mut payload).unwrap();
        }
        assert!(read_frame(&mut r, &mut payload).is_err(), "a flipped bit");
        assert!(
            read_frame(&mut &buf[..3], &mut payload).is_err(),
            "a cut frame"
        );
    }
}
