//! The keeper's shortlist of the working set, found by path.

use std::hash::BuildHasher;

use crate::profile::shortlist::{File, Shortlist};

/// The remembered shortlist's files by path, without a second copy of each path (100k of
/// them for a site-wide profile): a table of indices into the shortlist, hashed by path.
#[derive(Default)]
pub struct FileIndex {
    table: hashbrown::HashTable<u32>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl FileIndex {
    pub fn of(shortlist: &Shortlist) -> Self {
        let mut index = Self::default();
        index.table.reserve(shortlist.len(), |_| 0);
        let Self { table, hasher } = &mut index;
        for (i, f) in shortlist.files().enumerate() {
            // The first of a path twice is the one found.
            let _ = table
                .entry(
                    hasher.hash_one(f.path),
                    |&j| shortlist.path(j as usize) == f.path,
                    |&j| hasher.hash_one(shortlist.path(j as usize)),
                )
                .or_insert(i as u32);
        }
        index
    }

    pub fn find<'a>(&self, shortlist: &'a Shortlist, path: &str) -> Option<File<'a>> {
        shortlist.file(self.position(shortlist, path)?)
    }

    /// Where in `shortlist` the file at `path` is.
    pub fn position(&self, shortlist: &Shortlist, path: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(path);
        let &i = self
            .table
            .find(hash, |&j| shortlist.path(j as usize) == path)?;
        Some(i as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::format::FileEntry;

    #[test]
    fn finds_each_file_by_its_path_and_nothing_else() {
        let files: Vec<FileEntry> = ["/net/a.py", "/net/b.so", "/net/dir/a.py"]
            .iter()
            .map(|p| FileEntry {
                path: (*p).into(),
                ..Default::default()
            })
            .collect();
        let shortlist = Shortlist::of_files(&files);
        let index = FileIndex::of(&shortlist);
        for (i, f) in files.iter().enumerate() {
            assert_eq!(
                index.find(&shortlist, &f.path).map(|g| g.path),
                Some(&*f.path)
            );
            assert_eq!(index.position(&shortlist, &f.path), Some(i));
        }
        assert!(index.find(&shortlist, "/net/c.py").is_none());
        assert!(index.find(&shortlist, "/net").is_none());
        assert!(FileIndex::default().find(&shortlist, "/net/a.py").is_none());
    }
}
