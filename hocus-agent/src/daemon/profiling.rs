//! The working set as the daemon keeps it: recorded by the tracer, saved to the state
//! directory every interval when it changed (a save that fails is retried and reported;
//! a whole snapshot is written a slice per turn of the loop, `store::Sliced`), placed
//! again when it changed, bounded (`max-profile-entries`, said once when reached).

use std::{
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Result;
use hocus_control::status::RootTotals;

use crate::{
    profile::{
        format::{FileEntry, Profile},
        records,
        store::{SLICE, Sliced, StateDir},
        working_set::{Attributes, WorkingSet},
    },
    shared::memory,
};

pub struct Profiling {
    pub ws: WorkingSet,
    state: StateDir,
    /// Changed since it was last saved.
    dirty: bool,
    /// Changed since it was last placed.
    to_place: bool,
    last_save_error: Option<String>,
    /// The bound was reached, and said.
    said_full: bool,
    /// A snapshot being written, a slice at a time.
    sliced: Option<Sliced>,
    /// The last status summary, kept while the set does not change: at a million files
    /// it is a pass over every record (~20 ms, twice that on a busy node).
    summary: Option<Summary>,
}

/// What [`WorkingSet::summary`] said, and of what: the set's edits, how many hottest
/// files, which trees.
struct Summary {
    edits: u64,
    top: usize,
    roots: Vec<PathBuf>,
    said: (Vec<FileEntry>, Vec<RootTotals>),
}

impl Profiling {
    /// Locks the state directory and continues the profile kept there, with at most
    /// `limit` entries.
    pub fn load(state_dir: &Path, limit: usize) -> Result<Self> {
        let mut state = StateDir::lock(state_dir)?;
        // A site-wide profile's file records live on local disk, beside its state.
        records::spill_into(state_dir);
        let mut ws = WorkingSet::new(unix_now_ns());
        ws.set_limit(limit);
        match state.load(&mut ws) {
            Ok(()) => {
                let (files, missing, _) = ws.counts();
                if files + missing > 0 {
                    log::info!(
                        "continuing the profile in {} ({files} files, {missing} missing names)",
                        state.profile_path().display(),
                    );
                }
            }
            Err(message) => log::error!("{message}"),
        }
        Ok(Self {
            ws,
            state,
            dirty: false,
            to_place: true,
            last_save_error: None,
            said_full: false,
            sliced: None,
            summary: None,
        })
    }

    pub fn profile_path(&self) -> std::path::PathBuf {
        self.state.profile_path()
    }

    /// The working set changed: to be saved and placed.
    pub fn changed(&mut self) {
        self.dirty = true;
        self.to_place = true;
    }

    /// The `top` hottest files and the totals under each of `roots`
    /// ([`WorkingSet::summary`]), taken again only once the set changed.
    pub fn summary(&mut self, top: usize, roots: &[PathBuf]) -> (Vec<FileEntry>, Vec<RootTotals>) {
        let edits = self.ws.edits();
        let kept = self
            .summary
            .as_ref()
            .is_some_and(|s| s.edits == edits && s.top >= top && s.roots == roots);
        if !kept {
            // As many hottest as the last one asked: a status and a scrape take turns.
            let n = top.max(self.summary.as_ref().map_or(0, |s| s.top));
            self.summary = Some(Summary {
                edits,
                top: n,
                roots: roots.to_vec(),
                said: self.ws.summary(n, roots),
            });
        }
        let (hottest, totals) = &self.summary.as_ref().expect("kept or taken above").said;
        (hottest[..top.min(hottest.len())].to_vec(), totals.clone())
    }

    /// Whether it changed since it was last placed; from now on it has not.
    pub fn take_to_place(&mut self) -> bool {
        std::mem::take(&mut self.to_place)
    }

    pub fn wants_placing(&self) -> bool {
        self.to_place
    }

    /// A file's size and mtime, read from its tree.
    pub fn stat_done(&mut self, path: &str, attrs: Option<Attributes>) {
        if let Some(attrs) = attrs {
            self.ws.set_attributes(path, attrs);
            self.dirty = true;
        }
    }

    /// Saves what changed; a failure is logged once per message and retried. A whole
    /// snapshot is only begun: [`Profiling::write_slice`] writes it.
    pub fn save(&mut self) {
        self.sliced_done();
        if !self.dirty || self.sliced.is_some() {
            return;
        }
        match self.state.save_or_begin(&mut self.ws) {
            Ok(sliced) => {
                self.dirty = false;
                if sliced.is_none() {
                    self.last_save_error = None;
                }
                self.sliced = sliced;
            }
            Err(e) => self.save_failed(e),
        }
    }

    /// Whether a snapshot has slices to write (then the loop calls `write_slice`).
    pub fn slicing(&self) -> bool {
        self.sliced.as_ref().is_some_and(Sliced::handing_over)
    }

    /// Writes the next slice of the snapshot being written; once its writer has finished,
    /// it is in place (or its failure said).
    pub fn write_slice(&mut self) {
        if let Some(sliced) = &mut self.sliced
            && !sliced.next_slice(&self.ws, SLICE)
        {
            self.sliced_done();
        }
    }

    /// Takes the result of the snapshot being written, if its writer has finished.
    fn sliced_done(&mut self) {
        let Some(result) = self.sliced.as_ref().and_then(Sliced::result) else {
            return;
        };
        let sliced = self.sliced.take().expect("checked above");
        match self.state.sliced_done(&sliced, result, &mut self.ws) {
            Ok(()) => self.last_save_error = None,
            Err(e) => {
                self.dirty = true;
                self.save_failed(e);
            }
        }
    }

    fn save_failed(&mut self, e: anyhow::Error) {
        let message = format!("{e:#}");
        if self.last_save_error.as_deref() != Some(&message) {
            log::error!("{message}; will retry");
        }
        self.last_save_error = Some(message);
    }

    /// Saves it whole now, as the daemon stops (a snapshot being written is finished
    /// first).
    pub fn save_last(&mut self) {
        if let Some(mut sliced) = self.sliced.take() {
            let result = sliced.finish(&self.ws);
            if let Err(e) = self.state.sliced_done(&sliced, result, &mut self.ws) {
                self.save_failed(e);
            }
        }
        self.dirty = true;
        match self.state.save(&mut self.ws) {
            Ok(()) => self.last_save_error = None,
            Err(e) => self.save_failed(e),
        }
    }

    pub fn last_save_error(&self) -> Option<&str> {
        self.last_save_error.as_deref()
    }

    /// Merges a checked profile a client sent, to be placed.
    pub fn merge(&mut self, set: WorkingSet) {
        self.ws.merge_state(set);
        self.changed();
        self.save();
        // The import's batches and staging are gone (a site-wide one: tens of MiB).
        memory::give_back();
    }

    /// Merges a profile sent to prefetch from, placed now (not later); returns what the
    /// daemon knows of its files (sizes, writes seen), not only what the sender said.
    pub fn merge_to_prefetch(&mut self, set: WorkingSet) -> Profile {
        self.ws.merge_set(&set);
        self.dirty = true;
        self.to_place = false;
        self.save();
        self.ws.profile_for(&set)
    }

    /// Says once that the bound was reached.
    pub fn say_if_full(&mut self, limit: usize) {
        if self.ws.dropped() > 0 && !self.said_full {
            log::warn!(
                "the working set holds its most entries ({limit}, max-profile-entries): new names read are no longer recorded (writes still are); counted in status and hocus_profile_entries_dropped_total"
            );
            self.said_full = true;
        }
    }
}

pub fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}
