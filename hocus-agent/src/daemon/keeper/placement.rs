//! The keeper's last placement: the shortlist of the working set it placed (found by path
//! through its index), which of its files are wanted and which pinned, and when.

use std::{collections::HashMap, time::Instant};

use super::file_index::FileIndex;
use crate::{
    profile::shortlist::{File, Shortlist},
    shared::user::User,
};

pub struct Placement {
    /// The last shortlist of the working set, and where each file is in it.
    shortlist: Shortlist,
    index: FileIndex,
    /// Each file of the shortlist, by place: wanted, and whether it is to be pinned. Indices,
    /// not paths: a site-wide placement wants 100k files.
    wanted: Vec<Option<bool>>,
    /// The files copied in part given less than their ranges (the rest of the SSD
    /// budget), by place: the bytes a new copy of each holds.
    shares: HashMap<u32, u64>,
    /// When the working set was last placed.
    placed_at: Instant,
}

impl Placement {
    pub fn new() -> Self {
        Self {
            shortlist: Shortlist::default(),
            index: FileIndex::default(),
            wanted: Vec::new(),
            shares: HashMap::new(),
            placed_at: Instant::now(),
        }
    }

    pub fn shortlist(&self) -> &Shortlist {
        &self.shortlist
    }

    /// Takes a new shortlist of the working set; nothing of it is wanted until it is placed.
    pub fn remember(&mut self, shortlist: Shortlist) {
        // The old shortlist goes first: two site-wide shortlists at once are ~24 MiB.
        self.shortlist = Shortlist::default();
        self.index = FileIndex::of(&shortlist);
        self.shortlist = shortlist;
        self.wanted = Vec::new();
        self.shares = HashMap::new();
    }

    /// Whether the last placement wants `source`, and pinned.
    pub fn wanted(&self, source: &str) -> Option<bool> {
        let i = self.index.position(&self.shortlist, source)?;
        self.wanted.get(i).copied().flatten()
    }

    /// Whether `path` is in the shortlist and not wanted: placed, and left out.
    pub fn left_out(&self, path: &str) -> bool {
        self.index
            .position(&self.shortlist, path)
            .is_some_and(|i| self.wanted.get(i).copied().flatten().is_none())
    }

    /// The file at `path`, if placement weighed it.
    pub fn weighed(&self, path: &str) -> Option<File<'_>> {
        self.index.find(&self.shortlist, path)
    }

    /// Where in the shortlist the file at `path` is, if placement weighed it.
    pub fn position(&self, path: &str) -> Option<usize> {
        self.index.position(&self.shortlist, path)
    }

    /// A user seen reading `source` (`File::reader`), whose credentials copy it.
    pub fn reader_of(&self, source: &str) -> Option<User> {
        let uid = self.weighed(source)?.reader()?;
        if uid == 0 {
            Some(User::root())
        } else {
            User::lookup(uid)
        }
    }

    /// The working set is being placed now.
    pub fn placing(&mut self) {
        self.placed_at = Instant::now();
    }

    /// The placement decided: each file of the shortlist, by place, wanted and pinned or
    /// not, and the shares of those given less than their ranges.
    pub fn placed(&mut self, wanted: Vec<Option<bool>>, shares: HashMap<u32, u64>) {
        self.wanted = wanted;
        self.shares = shares;
    }

    /// The bytes the file at place `at` was given, if less than its ranges.
    pub fn share(&self, at: u32) -> Option<u64> {
        self.shares.get(&at).copied()
    }

    pub fn placed_at(&self) -> Instant {
        self.placed_at
    }
}
