//! The working set as placement and the cache keeper see it: files with the facts
//! placement weighs, missing names and directories. The files' paths are packed in one
//! string and their facts in 56 bytes each. A site-wide shortlist holds 100k files: as
//! `FileEntry`s, each with its path and its list of users on the heap, that took ~22 MiB,
//! and twice as much while a new shortlist replaced the last.

use std::{collections::HashMap, ops::Deref};

use crate::profile::{
    extents::Extents,
    format::{DirEntry, FileEntry, MissingEntry, Profile},
};

/// A shortlist of a working set (see the module).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shortlist {
    /// The files' paths, one after another.
    paths: String,
    files: Vec<Packed>,
    /// The byte ranges read of the files that have them (big files read in part, not
    /// mapped), by place in the shortlist: what a partial copy of each would hold.
    ranges: HashMap<u32, Extents>,
    pub missing: Vec<MissingEntry>,
    pub dirs: Vec<DirEntry>,
}

/// What placement weighs of a file.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Facts {
    pub size: u64,
    pub bytes_read: u64,
    pub first_touch_ns: u64,
    /// Saturating at 2^32, as the working set counts them.
    pub opens: u32,
    pub write_opens: u32,
    pub written: bool,
    /// A job was refused a write through a read-only copy of it.
    pub refused: bool,
    /// Some process mapped it: a partial copy would be filled whole at the mapping.
    pub mapped: bool,
    /// Opened by a job that started after its last write.
    pub read_back: bool,
}

impl Facts {
    /// The facts of a profile's entry.
    pub fn of(f: &FileEntry) -> Self {
        Facts {
            size: f.size,
            bytes_read: f.bytes_read,
            first_touch_ns: f.first_touch_ns,
            opens: saturated(f.opens),
            write_opens: saturated(f.write_opens),
            written: f.written,
            refused: f.refused,
            mapped: f.mapped,
            read_back: f.read_back,
        }
    }

    /// Opened for writing again and again (a lock file, JAX's `-atime` files rewritten
    /// on every cache hit), not just written once and then read (a package installed,
    /// later upgraded): a read-only copy would break its next writer.
    pub fn opened_for_writing(&self) -> bool {
        self.write_opens >= 2 && u64::from(self.write_opens) * 4 >= u64::from(self.opens)
    }

    /// Written or opened for writing at least once.
    pub fn changed(&self) -> bool {
        self.written || self.write_opens > 0
    }

    /// Never to be copied or bound.
    pub fn kept_on_the_network(&self) -> bool {
        self.refused || self.opened_for_writing()
    }
}

/// A file as the shortlist holds it: its facts, where its path is, who to read it as.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Packed {
    facts: Facts,
    start: u32,
    len: u32,
    /// [`reader`] of its users, or `NO_READER`.
    reader: u32,
    /// Its place in the shortlist (in what would be padding: free).
    at: u32,
}

const NO_READER: u32 = u32::MAX;

/// A user to read a file as, among those who opened it: an ordinary user if there is one
/// (root is squashed on most NFS exports and must not read more than users can).
fn reader(uids: &[u32]) -> Option<u32> {
    uids.iter()
        .copied()
        .find(|u| *u != 0)
        .or_else(|| uids.first().copied())
}

fn saturated(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A file of a shortlist: its path and its facts.
#[derive(Debug, Clone, Copy)]
pub struct File<'a> {
    pub path: &'a str,
    packed: &'a Packed,
}

impl File<'_> {
    /// Its place in the shortlist ([`Shortlist::file`]).
    pub fn at(&self) -> usize {
        self.packed.at as usize
    }

    /// The byte ranges jobs read of it, if it was read in part and never mapped.
    pub fn ranges<'v>(&self, shortlist: &'v Shortlist) -> Option<&'v Extents> {
        shortlist.ranges.get(&self.packed.at)
    }

    /// The user to read it as when copying it (see [`reader`]).
    pub fn reader(&self) -> Option<u32> {
        let r = self.packed.reader;
        (r != NO_READER).then_some(r)
    }
}

impl Deref for File<'_> {
    type Target = Facts;
    fn deref(&self) -> &Facts {
        &self.packed.facts
    }
}

impl Shortlist {
    /// Adds a file opened by `uids`; `path` writes its path (a working set builds it from
    /// its interned parts, not as a string of its own).
    pub fn push_file(&mut self, facts: Facts, uids: &[u32], path: impl FnOnce(&mut String)) {
        let start = self.paths.len();
        path(&mut self.paths);
        let len = self.paths.len() - start;
        // Past 4 GiB of paths (40M files of 100 bytes), a shortlist would be far past its bound.
        let (Ok(start32), Ok(len), Ok(at)) = (
            u32::try_from(start),
            u32::try_from(len),
            u32::try_from(self.files.len()),
        ) else {
            self.paths.truncate(start);
            return;
        };
        self.files.push(Packed {
            facts,
            start: start32,
            len,
            reader: reader(uids).unwrap_or(NO_READER),
            at,
        });
    }

    /// Gives the file last pushed the byte ranges jobs read of it (not for a mapped
    /// file: a mapping asks for all it maps).
    pub fn set_last_ranges(&mut self, ranges: Extents) {
        let Some(last) = self.files.last() else {
            return;
        };
        if !last.facts.mapped && !ranges.is_empty() {
            self.ranges.insert(last.at, ranges);
        }
    }

    pub fn file(&self, i: usize) -> Option<File<'_>> {
        let packed = self.files.get(i)?;
        Some(File {
            path: self.path_of(packed),
            packed,
        })
    }

    /// The path of the file at `i`; "" if there is none.
    pub fn path(&self, i: usize) -> &str {
        self.files.get(i).map_or("", |p| self.path_of(p))
    }

    fn path_of(&self, packed: &Packed) -> &str {
        let (start, len) = (packed.start as usize, packed.len as usize);
        &self.paths[start..start + len]
    }

    pub fn files(&self) -> impl Iterator<Item = File<'_>> {
        (0..self.files.len()).filter_map(|i| self.file(i))
    }

    /// The directories jobs used: those holding a file they read (not one they wrote:
    /// what is written is the network's), or a name they probed and found missing, and
    /// those they listed. A directory may come more than once.
    pub fn used_dirs(&self) -> impl Iterator<Item = &std::path::Path> {
        use std::path::Path;
        self.files()
            .filter(|f| f.opens > 0 && !f.written)
            .map(|f| f.path)
            .chain(self.missing.iter().map(|m| m.path.as_str()))
            .filter_map(|p| Path::new(p).parent())
            .chain(
                self.dirs
                    .iter()
                    .filter(|d| d.opens > 0)
                    .map(|d| Path::new(d.path.as_str())),
            )
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Bytes held on the heap by its files (what placement is sent).
    #[cfg(test)]
    pub fn file_bytes(&self) -> usize {
        self.paths.capacity() + self.files.capacity() * size_of::<Packed>()
    }

    /// A shortlist of these files alone.
    #[cfg(test)]
    pub fn of_files(files: &[FileEntry]) -> Self {
        Shortlist::of(files, Vec::new(), Vec::new())
    }

    fn of(files: &[FileEntry], missing: Vec<MissingEntry>, dirs: Vec<DirEntry>) -> Self {
        let mut shortlist = Shortlist {
            paths: String::with_capacity(files.iter().map(|f| f.path.len()).sum()),
            files: Vec::with_capacity(files.len()),
            ranges: HashMap::new(),
            missing,
            dirs,
        };
        for f in files {
            shortlist.push_file(Facts::of(f), &f.uids, |out| out.push_str(&f.path));
            if let Some(ranges) = Extents::from_bytes(&f.ranges) {
                shortlist.set_last_ranges(ranges);
            }
        }
        shortlist
    }
}

impl From<&Profile> for Shortlist {
    fn from(p: &Profile) -> Self {
        Shortlist::of(&p.files, p.missing.clone(), p.dirs.clone())
    }
}

impl From<Profile> for Shortlist {
    fn from(p: Profile) -> Self {
        Shortlist::of(&p.files, p.missing, p.dirs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_keep_their_paths_and_facts() {
        let profile = Profile {
            files: vec![
                FileEntry {
                    path: "/net/a.py".into(),
                    size: 10,
                    opens: 1 << 40,
                    uids: vec![0, 1000, 1001],
                    ..Default::default()
                },
                FileEntry {
                    path: "/net/é/b.so".into(),
                    write_opens: 3,
                    opens: 3,
                    uids: vec![0],
                    refused: true,
                    ..Default::default()
                },
                FileEntry {
                    path: "/net/c".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let shortlist = Shortlist::from(&profile);
        let files: Vec<File> = shortlist.files().collect();
        assert_eq!(files.len(), 3);
        assert_eq!(
            files.iter().map(|f| f.path).collect::<Vec<_>>(),
            ["/net/a.py", "/net/é/b.so", "/net/c"]
        );
        assert_eq!((files[0].size, files[0].opens), (10, u32::MAX));
        assert_eq!(files[0].reader(), Some(1000), "an ordinary user first");
        assert_eq!(files[1].reader(), Some(0), "root when no one else");
        assert_eq!(files[2].reader(), None);
        assert!(files[1].opened_for_writing() && files[1].kept_on_the_network());
        assert!(!files[0].kept_on_the_network());
        assert!(shortlist.file(3).is_none());
        assert_eq!(files.iter().map(File::at).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(Shortlist::from(profile), shortlist);
    }

    #[test]
    fn files_read_in_part_keep_their_ranges_unless_mapped() {
        let file = |path: &str, mapped| FileEntry {
            path: path.into(),
            size: 1 << 30,
            mapped,
            ranges: vec![[1 << 20, 2 << 20]],
            ..Default::default()
        };
        let shortlist = Shortlist::from(&Profile {
            files: vec![file("/net/a.h5", false), file("/net/b.npy", true)],
            ..Default::default()
        });
        let files: Vec<File> = shortlist.files().collect();
        assert_eq!(files[0].ranges(&shortlist).unwrap().grains(), [(16, 32)]);
        assert!(
            files[1].ranges(&shortlist).is_none(),
            "a mapped file is copied whole"
        );
    }

    #[test]
    fn a_file_takes_its_facts_and_the_bytes_of_its_path() {
        let files: Vec<FileEntry> = (0..1000)
            .map(|i| FileEntry {
                path: format!("/net/env/lib/m{i:05}.py"),
                uids: vec![1000, 1001],
                ..Default::default()
            })
            .collect();
        let shortlist = Shortlist::of_files(&files);
        assert_eq!(shortlist.file_bytes(), 1000 * (size_of::<Packed>() + 22));
        assert!(size_of::<Packed>() <= 56);
    }
}
