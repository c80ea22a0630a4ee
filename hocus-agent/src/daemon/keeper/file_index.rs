//! The keeper's view of the working set, found by path.

use std::hash::BuildHasher;

use crate::profile::format::FileEntry;

/// The remembered view's files by path, without a second copy of each path (100k of
/// them for a site-wide profile): a table of indices into the view, hashed by path.
#[derive(Default)]
pub struct FileIndex {
    table: hashbrown::HashTable<u32>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl FileIndex {
    pub fn of(files: &[FileEntry]) -> Self {
        let mut index = Self::default();
        index.table.reserve(files.len(), |_| 0);
        let Self { table, hasher } = &mut index;
        for (i, f) in files.iter().enumerate() {
            // The first of a path twice is the one found.
            let _ = table
                .entry(
                    hasher.hash_one(f.path.as_str()),
                    |&j| files[j as usize].path == f.path,
                    |&j| hasher.hash_one(files[j as usize].path.as_str()),
                )
                .or_insert(i as u32);
        }
        index
    }

    pub fn find<'a>(&self, files: &'a [FileEntry], path: &str) -> Option<&'a FileEntry> {
        files.get(self.position(files, path)?)
    }

    /// Where in `files` the file at `path` is.
    pub fn position(&self, files: &[FileEntry], path: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(path);
        let &i = self.table.find(hash, |&j| files[j as usize].path == path)?;
        Some(i as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_each_file_by_its_path_and_nothing_else() {
        let files: Vec<FileEntry> = ["/net/a.py", "/net/b.so", "/net/dir/a.py"]
            .iter()
            .map(|p| FileEntry {
                path: (*p).into(),
                ..Default::default()
            })
            .collect();
        let index = FileIndex::of(&files);
        for (i, f) in files.iter().enumerate() {
            assert_eq!(index.find(&files, &f.path).map(|g| &g.path), Some(&f.path));
            assert_eq!(index.position(&files, &f.path), Some(i));
        }
        assert!(index.find(&files, "/net/c.py").is_none());
        assert!(index.find(&files, "/net").is_none());
        assert!(FileIndex::default().find(&files, "/net/a.py").is_none());
    }
}
