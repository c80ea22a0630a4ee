//! Writing a profile in the file format as it comes, part by part (an export of a
//! million files is never held whole).

use std::io::{self, Write};

use serde::Serialize;

use hocus_control::profile::{FORMAT_VERSION, Profile};

use super::Holder;

/// Writes a profile in the file format as it comes, part by part (files, then missing
/// names, then directories), so that no whole profile need be held: one entry per line.
pub struct ProfileWriter<W: Write> {
    out: W,
    /// The head (version, start) is written: with the first part, which says the start.
    begun: bool,
    /// The list being written: 0 files, 1 missing names, 2 directories, 3 closed.
    list: usize,
    first: bool,
    /// Files, missing names and directories written.
    pub written: [usize; 3],
}

const LISTS: [&str; 3] = ["files", "missing", "dirs"];

impl<W: Write> ProfileWriter<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            begun: false,
            list: 0,
            first: true,
            written: [0; 3],
        }
    }

    fn begin(&mut self, started_unix_ns: u64) -> io::Result<()> {
        if !self.begun {
            self.begun = true;
            write!(
                self.out,
                "{{\n  \"version\": {FORMAT_VERSION},\n  \"started_unix_ns\": {started_unix_ns},\n  \"files\": ["
            )?;
        }
        Ok(())
    }

    /// Appends a part's entries; a part's lists come after those already written.
    pub fn part(&mut self, p: &Profile) -> io::Result<()> {
        self.begin(p.started_unix_ns)?;
        for f in &p.files {
            self.entry(0, f)?;
        }
        for m in &p.missing {
            self.entry(1, m)?;
        }
        for d in &p.dirs {
            self.entry(2, d)?;
        }
        Ok(())
    }

    fn entry(&mut self, list: usize, e: &impl Serialize) -> io::Result<()> {
        if list < self.list {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a {} entry came after the {} list",
                    LISTS[list], LISTS[self.list]
                ),
            ));
        }
        self.open(list)?;
        self.out
            .write_all(if self.first { b"\n    " } else { b",\n    " })?;
        self.first = false;
        serde_json::to_writer(&mut self.out, e)?;
        self.written[list] += 1;
        Ok(())
    }

    /// Closes the lists before `list` and opens it.
    fn open(&mut self, list: usize) -> io::Result<()> {
        while self.list < list {
            self.out
                .write_all(if self.first { b"]" } else { b"\n  ]" })?;
            self.list += 1;
            self.first = true;
            if let Some(name) = LISTS.get(self.list) {
                write!(self.out, ",\n  \"{name}\": [")?;
            }
        }
        Ok(())
    }

    /// Closes the profile; returns the writer, flushed.
    pub fn finish(self) -> io::Result<W> {
        self.finish_held(None)
    }

    /// The same, naming the node whose cache holds its files (a Slurm job's, saved).
    pub fn finish_held(mut self, holder: Option<&Holder>) -> io::Result<W> {
        self.begin(0)?;
        self.open(LISTS.len())?;
        if let Some(h) = holder {
            self.out.write_all(b",\n  \"holder\": ")?;
            serde_json::to_writer(&mut self.out, h)?;
        }
        self.out.write_all(b"\n}\n")?;
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::profile::format::to_json;
    use crate::profile::format::{DirEntry, FileEntry, MissingEntry};

    #[test]
    fn a_profile_written_part_by_part_is_one_document() {
        let p = Profile {
            version: FORMAT_VERSION,
            started_unix_ns: 7,
            files: (0..3)
                .map(|i| FileEntry {
                    path: format!("/net/home/\"{i}\""),
                    size: i,
                    ..Default::default()
                })
                .collect(),
            missing: vec![MissingEntry {
                path: "/net/home/no".into(),
                ..Default::default()
            }],
            dirs: vec![DirEntry {
                path: "/net/home".into(),
                opens: 1,
                mutated: true,
            }],
        };
        let mut w = ProfileWriter::new(Vec::new());
        for f in &p.files {
            w.part(&Profile {
                started_unix_ns: 7,
                files: vec![f.clone()],
                ..Default::default()
            })
            .unwrap();
        }
        w.part(&Profile {
            missing: p.missing.clone(),
            dirs: p.dirs.clone(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(w.written, [3, 1, 1]);
        let bytes = w.finish().unwrap();
        assert_eq!(Profile::from_json(&bytes, Path::new("x"), "").unwrap(), p);
        assert_eq!(bytes, to_json(&p));
        // An empty profile, and a file after the missing names, which the format cannot say.
        let mut w = ProfileWriter::new(Vec::new());
        w.part(&Profile {
            started_unix_ns: 1,
            ..Default::default()
        })
        .unwrap();
        let empty = w.finish().unwrap();
        let back = Profile::from_json(&empty, Path::new("x"), "").unwrap();
        assert_eq!((back.started_unix_ns, back.len()), (1, 0));
        let mut w = ProfileWriter::new(Vec::new());
        w.part(&Profile {
            missing: p.missing.clone(),
            ..Default::default()
        })
        .unwrap();
        let late = Profile {
            files: p.files.clone(),
            ..Default::default()
        };
        assert!(w.part(&late).is_err());
    }
}
