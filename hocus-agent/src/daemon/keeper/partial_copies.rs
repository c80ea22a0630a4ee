//! The keeper's partial copies (docs/partial-copies.md): which placed copies jobs have
//! outgrown (made whole) or read more of since (grown), serving one that landed, their
//! counts as jobs' reads fill them, eviction by range, and the ones a daemon before
//! made, served again.

use std::{
    os::unix::fs::MetadataExt,
    path::Path,
    time::{Duration, Instant},
};

use super::{
    Keeper,
    work::{Copied, Work},
};
use crate::{
    cache::{
        copy::CopyError,
        directory::Cached,
        partial::{FillError, PartialCopy},
    },
    place::placement,
    profile::{extents::Extents, shortlist::File},
    shared::{identity::Identity, size::human, user::User},
};

/// How long a trim that fell short waits before the next.
const TRIM_AGAIN_AFTER: Duration = Duration::from_secs(10);

impl Keeper {
    /// Partial copies jobs have outgrown go first in the queue, to be made whole; also
    /// when a partial copy lands after the placement that saw its file read whole (a job
    /// reading a big file in order outruns its copy: no later placement would look).
    pub(super) fn requeue_outgrown(&mut self) {
        for at in self.outgrown_partial_copies() {
            self.copies.queue_first(at);
        }
        self.grow_partial_copies();
        self.start_queued();
    }

    /// Partial copies placed while their first job still read (its ranges then) take
    /// the ranges learned since, from the network, within their share and the SSD
    /// budget: the next job reads them locally rather than filling them as it reads.
    /// Counted as copies under way (a prefetch and `settled` wait for them).
    fn grow_partial_copies(&mut self) {
        let Some(partials) = self.partials.clone() else {
            return;
        };
        // The copies the filler serves (few), not the cache's every file.
        let growing: Vec<(String, Extents)> = partials
            .held()
            .into_iter()
            .filter(|(source, _)| {
                self.cache.get(source).is_some_and(|c| c.is_partial())
                    && !self.copies.in_flight(source)
            })
            .filter_map(|(source, _)| {
                let at = self.placement.position(&source)?;
                let f = self.placement.shortlist().file(at)?;
                let ranges = self.ranges_to_hold(at as u32, &f)?;
                Some((source, ranges))
            })
            .collect();
        for (source, ranges) in growing {
            let Some((growth, lacks)) = partials.growth(&source, &ranges) else {
                continue;
            };
            // Fills under way will hold what they took too: growth never takes it
            // again (it refilled what a fill had just punched for room). The growth
            // took its own bytes of the fills' room already (given back if it goes).
            let taken = (self.cache.used())
                .saturating_add(self.copies.reserved())
                .saturating_add(partials.filling().saturating_sub(lacks));
            let room = self.effective_ssd_budget.saturating_sub(taken);
            if lacks > room {
                continue; // the next placement, after evictions
            }
            log::debug!(
                "{source}: its partial copy takes the ranges learned since ({})",
                human(lacks)
            );
            self.copies.begin(&source, lacks);
            self.workers.send(Work::Grow {
                source,
                growth,
                ranges,
            });
        }
    }

    /// A partial copy took the ranges learned since it was made, or failed to.
    pub(super) fn grown(&mut self, source: String, result: Result<(), FillError>) {
        let Some(expected) = self.copies.end(&source) else {
            return; // dropped meanwhile (changed, evicted)
        };
        let ok = result.is_ok();
        match result {
            Ok(()) => self.count_partial_copies(),
            Err(FillError::Changed) => {
                log::info!("{source} changed on the network: its partial copy goes");
                self.copies.changed(source.clone());
                self.drop_copy(&source);
            }
            Err(e) => log::debug!("{source}: its partial copy took no more: {e}"),
        }
        self.start_queued();
        if self.copies.under_way() == 0 {
            self.consider_snapshots();
        }
        // A prefetch that started meanwhile waits for it, as for any copy under way.
        let (settling, pinned) = (self.settling(), self.pinned_now());
        self.prefetches
            .copy_done(&source, expected, ok, settling, pinned);
    }

    /// The wanted files (places in the shortlist) whose partial copy jobs have outgrown: read
    /// whole since (a job reading it all from the copy would fill it from the network at
    /// read-ahead pace), mapped, or below `partial-from` now. Their copies go, to be
    /// made whole; one that jobs' reads filled whole already is kept as a whole copy.
    fn outgrown_partial_copies(&mut self) -> Vec<u32> {
        // The cache's partial copies are few; the wanted files may be millions.
        let outgrown: Vec<(usize, String, Cached)> = self
            .cache
            .sources()
            .filter(|(source, c)| c.is_partial() && self.placement.wanted(source).is_some())
            .filter_map(|(source, c)| {
                let at = self.placement.position(source)?;
                let f = self.placement.shortlist().file(at)?;
                self.partial_ranges(&f)
                    .is_none()
                    .then(|| (at, source.clone(), *c))
            })
            .collect();
        let mut again = Vec::new();
        for (at, source, entry) in outgrown {
            if entry.held >= entry.identity.size {
                // Filled whole by jobs' reads (and so unmarked): a whole copy now, pinned
                // whole if pinned (its pin held the ranges it had).
                self.cache.insert(&source, entry.identity);
                if self.pinning.has(&source) {
                    self.pinning.unpin(&source);
                    self.pin(&source);
                }
                continue;
            }
            log::info!("{source}: jobs read it whole now: its partial copy goes for a whole one");
            self.drop_copy(&source);
            again.push(at as u32);
        }
        again
    }

    /// The ranges a partial copy of `f` would hold, if it is to have one: partial copies
    /// are made here, and `placement::copied_in_part` says so.
    pub(super) fn partial_ranges(&self, f: &File) -> Option<&Extents> {
        placement::copied_in_part(f, self.placement.shortlist(), self.partial_from())
    }

    /// What the partial copy of `f` (at `at` in the shortlist) is to hold: its ranges, or
    /// given less than them, the first of them up to its share.
    pub(super) fn ranges_to_hold(&self, at: u32, f: &File) -> Option<Extents> {
        let ranges = self.partial_ranges(f)?;
        Some(match self.placement.share(at) {
            Some(share) => ranges.cut_to(share, f.size),
            None => ranges.clone(),
        })
    }

    /// From what size files read in part get partial copies here (0: none made).
    pub(super) fn partial_from(&self) -> u64 {
        self.partials
            .as_ref()
            .map_or(0, |_| self.config.partial_from)
    }

    /// Serves `copy` (its file `file`) and records it in the cache; the bytes it holds.
    /// One that cannot be served is deleted: its holes would read as zeros.
    pub(super) fn serve_partial(
        &mut self,
        source: &str,
        identity: Identity,
        copy: PartialCopy,
        file: &std::fs::File,
        reader: Option<u32>,
    ) -> Option<u64> {
        let held = file.metadata().map_or(0, |m| m.blocks() * 512);
        let served = match (&self.partials, reader) {
            (Some(p), Some(_)) => p.serve(copy, file),
            (None, _) => Err(std::io::Error::other("no partial copies here")),
            (_, None) => Err(std::io::Error::other("no user is known to read it")),
        };
        if let Err(e) = served {
            log::warn!("not keeping the partial copy of {source}: serving it: {e}");
            let _ = std::fs::remove_file(self.cache.local(source));
            return None;
        }
        let reader = reader.expect("served only with a reader");
        self.cache.insert_partial(source, identity, held, reader);
        Some(held)
    }

    /// Brings the cache's count of what partial copies hold up to date (they grow as
    /// jobs' reads fill them: budgets count it), and retires those the cache no longer
    /// holds (dropped, changed, evicted) from the filler.
    pub(super) fn count_partial_copies(&mut self) {
        let Some(partials) = self.partials.clone() else {
            return;
        };
        for (source, held) in partials.held() {
            match self.cache.get(&source) {
                Some(c) if c.is_partial() => self.cache.set_held(&source, held),
                _ => partials.retire(&source),
            }
        }
        // Fills take their bytes of what the budget has left, while jobs run too.
        let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
        partials
            .set_room(bytes(self.effective_ssd_budget).saturating_sub(bytes(self.cache.used())));
        let trimmed = partials.trimmed_by_fills();
        self.note_trimmed(&trimmed);
        if self.jobs.running() == 0 {
            partials.release_retired();
            self.trim_partial_copies();
        }
    }

    /// Eviction by range: while the cache holds more than the SSD budget (jobs' reads
    /// filled its partial copies past it), the chunks of partial copies read least
    /// lately are punched out, coldest first, rather than whole copies evicted. Only
    /// while no job runs, so that no read can meet a hole just punched. A trimmed copy's
    /// pin goes (the next placement pins what it holds now).
    fn trim_partial_copies(&mut self) {
        let over = self.cache.used().saturating_sub(self.effective_ssd_budget);
        let due = Instant::now() >= self.trim_after;
        let Some(partials) = self.partials.clone().filter(|_| over > 0 && due) else {
            return;
        };
        let trimmed = partials.trim_coldest(over);
        if trimmed.iter().map(|(_, freed)| freed).sum::<u64>() < over {
            self.trim_after = Instant::now() + TRIM_AGAIN_AFTER;
        }
        self.note_trimmed(&trimmed);
        for (source, freed) in &trimmed {
            if let Some(c) = self.cache.get(source).filter(|c| c.is_partial()) {
                let held = c.held.saturating_sub(*freed);
                self.cache.set_held(source, held);
            }
        }
    }

    /// Says what was punched out of partial copies, counts it, and lets their pins go
    /// (the next placement pins what they hold now).
    fn note_trimmed(&mut self, trimmed: &[(String, u64)]) {
        for (source, freed) in trimmed {
            log::info!(
                "{source}: {} of its partial copy read least lately punched out, to keep the cache within the SSD budget ({})",
                human(*freed),
                human(self.effective_ssd_budget)
            );
            self.status.partial_bytes_trimmed += freed;
            self.pinning.unpin(source);
        }
    }

    /// Serves again the partial copies a previous daemon made (jobs may still read them
    /// through their binds, and the next ones find them held), each once found
    /// unchanged on the network; deleted where none are made now, or not of this size.
    pub(super) fn resume_partials(&mut self) {
        let from = self.config.partial_from;
        for (source, c) in self.cache.take_unserved() {
            let reader = match c.reader {
                Some(0) => Some(User::root()),
                Some(uid) => User::lookup(uid),
                None => None,
            };
            let tree = self.tree_of(Path::new(&source)).cloned();
            let made_now = self.partials.is_some() && from > 0 && c.identity.size >= from;
            let (true, Some(reader), Some(tree)) = (made_now, reader, tree) else {
                log::info!("{source}: a partial copy made before, not served again: deleted");
                self.cache.delete_unserved(&source);
                continue;
            };
            // As a copy under way: nothing copies it meanwhile, a change drops it.
            self.copies.begin(&source, c.held);
            self.workers.send(Work::Resume {
                dest: self.cache.local(&source),
                source,
                tree,
                reader,
                made_of: c.identity,
            });
        }
    }

    /// A partial copy found at the start was checked against the network.
    pub(super) fn resumed(
        &mut self,
        source: String,
        reader: u32,
        result: Result<Copied, CopyError>,
    ) {
        let under_way = self.copies.end(&source).is_some();
        match result {
            Ok(Copied {
                identity,
                partial: Some((copy, file)),
            }) if under_way => {
                if let Some(held) = self.serve_partial(&source, identity, copy, &file, Some(reader))
                {
                    log::info!(
                        "{source}: the partial copy made before is served again ({} held)",
                        human(held)
                    );
                }
            }
            Ok(_) => self.cache.delete_unserved(&source), // changed meanwhile
            Err(e) => {
                log::info!("{source}: the partial copy made before is dropped: {e}");
                self.cache.delete_unserved(&source);
            }
        }
        self.start_queued();
    }
}
