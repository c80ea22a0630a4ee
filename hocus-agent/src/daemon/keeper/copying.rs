//! The keeper's copies and pins, as a flow across its parts: placing the working set
//! (evictions, unpins, pins, then copies in the placement's order), each copy started
//! within the SSD budget and ending in the cache (or not, and why), pins within the RAM
//! budget, revalidation against the network, and new budgets.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    time::Instant,
};

use super::{
    Keeper, decide,
    prefetches::Pinned,
    schedule::Schedule,
    work::{Copied, Work},
};
use crate::{
    cache::{copy::CopyError, pins::Mapped},
    place::{budget::fs_space, placement},
    profile::{extents::Extents, shortlist::File},
    shared::{log_line as logs, size::human},
};

impl Keeper {
    /// The watched tree `path` is in.
    pub(super) fn tree_of(&self, path: &Path) -> Option<&PathBuf> {
        self.config.trees.iter().find(|t| path.starts_with(t))
    }

    /// Work a prefetch waits for beyond its own copies and snapshots: the pins they
    /// cause (a prefetch reports what it pinned) and the trees being measured for a
    /// snapshot (the snapshot it leads to is part of the warm-up).
    pub(super) fn settling(&self) -> bool {
        self.pinning.busy() || self.snapshots.measuring()
    }

    pub(super) fn pinned_now(&self) -> Pinned {
        Pinned {
            files: self.pinning.pins.len(),
            bytes: self.pinning.pins.bytes(),
        }
    }

    /// Computes the placement of the remembered working set and moves towards it.
    pub(super) fn place(&mut self) {
        self.placement.placing();
        self.copies.expire(self.config.revalidate);
        let known = self.copies.known(&self.config.trees);
        let shortlist = self.placement.shortlist();
        let admitted = decide::admitted(shortlist, &known);
        let (cache, copies, pinning, jobs) = (&self.cache, &self.copies, &self.pinning, &self.jobs);
        let in_use = |p: &str| {
            cache
                .get(p)
                .is_some_and(|c| jobs.uses_copy(p, c.is_partial()))
        };
        let held = decide::Held {
            cached: &|p| cache.contains(p),
            copying: &|p| copies.in_flight(p),
            pinned: &|p| pinning.has(p),
            copies: cache
                .sources()
                .map(|(s, c)| (s.as_str(), c.bytes()))
                .collect(),
            in_use: &in_use,
        };
        // A file to be copied in part takes the bytes of its ranges.
        let from = self.partial_from();
        let takes = |f: &File| placement::takes_in_part(f, shortlist, from);
        let moves = decide::moves(
            &admitted,
            &self.config.filters,
            (self.effective_ssd_budget, self.config.ram_budget),
            &takes,
            &held,
        );
        let mut wanted = vec![None; shortlist.len()];
        let mut shares = std::collections::HashMap::new();
        for c in &moves.wanted {
            wanted[c.at as usize] = Some(c.pinned);
            if c.cut {
                shares.insert(c.at, c.bytes);
            }
        }
        let queued: VecDeque<u32> = moves.copies().map(|c| c.at).collect();
        let pin: Vec<String> = moves.pin.iter().map(|p| (*p).to_owned()).collect();
        let (evict, unpin) = (moves.evict, moves.unpin);
        self.placement.placed(wanted, shares);
        // Openers are remembered only to name them when their copy lands: those of files
        // placed and not wanted, or held already, are forgotten.
        let (placement, cache) = (&self.placement, &self.cache);
        self.copies
            .keep_openers(|path| !placement.left_out(path) && !cache.contains(path));
        // Make room first: evictions and unpins.
        for source in evict {
            self.status.evictions += 1;
            log::info!(
                "evicting {source}: no longer among the hottest files that fit the SSD budget ({})",
                human(self.effective_ssd_budget)
            );
            self.drop_copy(&source);
        }
        for source in unpin {
            self.pinning.unpin(&source);
        }
        for source in pin {
            self.pin(&source);
        }
        self.copies.queue(queued);
        self.requeue_outgrown();
    }

    /// Starts the queued copies in the placement's order, up to `COPIES_AT_ONCE` under
    /// way; each copy that ends starts the next.
    pub(super) fn start_queued(&mut self) {
        while let Some(at) = self.copies.next_queued() {
            let Some(f) = self.placement.shortlist().file(at as usize) else {
                continue;
            };
            let (source, size) = (f.path.to_owned(), f.size);
            let ranges = self.ranges_to_hold(at, &f);
            // What happened since the placement: held, changed, or written by a job.
            if !self.cache.contains(&source) && !self.copies.held_back(&source) {
                self.start_copy(&source, size, ranges);
            }
        }
    }

    fn start_copy(&mut self, source: &str, size: u64, ranges: Option<Extents>) {
        // A partial copy takes the bytes of its ranges.
        let size = ranges.as_ref().map_or(size, |r| r.bytes(size));
        let reserved = self.copies.reserved();
        if self
            .cache
            .used()
            .saturating_add(reserved)
            .saturating_add(size)
            > self.effective_ssd_budget
        {
            return; // after the evictions under way; the next placement retries
        }
        let Some(tree) = self.tree_of(Path::new(source)).cloned() else {
            return;
        };
        if self.snapshots.coming(Path::new(source)) {
            return; // the snapshot copies it, with the rest of its tree
        }
        let Some(reader) = self.placement.reader_of(source) else {
            log::debug!("not copying {source}: no user is known to read it");
            return;
        };
        // The profile's size is a claim: the copy checks the real one against this room.
        let room = self
            .effective_ssd_budget
            .saturating_sub(self.cache.used().saturating_add(reserved));
        self.copies.begin(source, size);
        // A prefetch under way waits for it too.
        self.prefetches.wait_for_copy(source, size);
        self.workers.send(Work::Copy {
            source: source.to_owned(),
            tree,
            reader,
            dest: self.cache.local(source),
            room,
            parent: self.prefetches.parent.clone(),
            ranges,
        });
    }

    pub(super) fn copied(&mut self, source: String, result: Result<Copied, CopyError>) {
        let Some(expected) = self.copies.end(&source) else {
            // Invalidated while copying: whatever arrived is not wanted.
            if result.is_ok() && !self.cache.contains(&source) {
                let _ = std::fs::remove_file(self.cache.local(&source));
            }
            self.start_queued();
            return;
        };
        let mut ok = false;
        if let Err(e) = &result {
            *self
                .status
                .copy_failures_by_reason
                .entry(e.reason().to_owned())
                .or_default() += 1;
        }
        match result {
            Ok(copied) => {
                let partial = copied.partial.is_some();
                ok = self.keep_copy(&source, copied);
                if ok && partial {
                    self.requeue_outgrown();
                }
            }
            Err(CopyError::Changed) => {
                log::info!(
                    "{source} changed while being copied: discarded, fetched again once stable"
                );
                self.copies.changed(source.clone());
            }
            Err(CopyError::NoSpace) => self.cache_full(&source, expected),
            Err(e) => {
                let gone = "files not cached, gone from the network";
                // A user can make the others (files of theirs a root copy is refused).
                if !self.tally_gone(&e, gone, Path::new(&source)) {
                    crate::shared::tally::warn_limited!("not caching", "not caching {source}: {e}");
                }
                self.copies.failed(source.clone());
            }
        }
        // The next queued copy first: a prefetch waiting for this one waits for it too.
        self.start_queued();
        if self.copies.under_way() == 0 {
            // Snapshots wait for the copies under them (they are linked in); a prefetch
            // under way then waits for them too, so this comes before its report.
            self.consider_snapshots();
        }
        let (settling, pinned) = (self.settling(), self.pinned_now());
        self.prefetches
            .copy_done(&source, expected, ok, settling, pinned);
    }

    /// A copy landed: kept in the cache if it fits and is still wanted (then pinned if
    /// the placement says so); whether it was.
    fn keep_copy(&mut self, source: &str, copied: Copied) -> bool {
        let identity = copied.identity;
        self.status.copies += 1;
        let wanted = self.placement.wanted(source);
        let partial = copied.partial.is_some();
        match copied.partial {
            None => {
                self.status.copied_bytes += identity.size;
                self.cache.insert(source, identity);
            }
            Some((copy, file)) => {
                let reader = self.placement.weighed(source).and_then(|f| f.reader());
                let Some(held) = self.serve_partial(source, identity, copy, &file, reader) else {
                    return false;
                };
                self.status.copied_bytes += held;
            }
        }
        if self.cache.used() > self.effective_ssd_budget {
            log::info!(
                "not keeping {source}: at {} it is larger than the profile said and does not fit the SSD budget",
                human(identity.size)
            );
            self.cache.remove(source);
            return false;
        }
        if wanted.is_none() {
            self.cache.remove(source); // no longer wanted
            return false;
        }
        // Before the pin: it goes through the snapshot's inode.
        self.fill_stub(source, &identity);
        if wanted == Some(true) {
            self.pin(source);
        }
        if logs::writes() {
            let opens = self.placement.weighed(source).map_or(0, |f| f.opens);
            let held = if wanted == Some(true) {
                "SSD and RAM"
            } else {
                "SSD"
            };
            logs::file_line(
                "cache write",
                source,
                self.copies.opener(source).as_ref(),
                &format!(
                    "copied to {held}{} ({}, opened {opens} times)",
                    if partial { ", in part" } else { "" },
                    human(identity.size)
                ),
            );
        }
        true
    }

    /// ENOSPC: the cache filesystem holds less than the budget said. Shrink the budget to
    /// what the filesystem can hold of the cache, with a margin, and evict down to it.
    fn cache_full(&mut self, source: &str, size: u64) {
        self.status.cache_full_events += 1;
        // What the filesystem can hold of the cache: its copies, the copies under way
        // (as far as they are written: at most what the filesystem holds beyond the
        // copies), and what is free. Counting only the free space after a full disk's
        // ENOSPC left room for nothing (the copies under way filled it, and then every
        // one that landed was dropped); counting every reservation, more than the disk.
        let used = self.cache.used();
        let new_budget = match fs_space(&self.config.cache_dir) {
            Ok((free, total)) => {
                let written = total.saturating_sub(free).saturating_sub(used);
                used + free + self.copies.reserved().min(written)
            }
            Err(_) => used + self.copies.reserved(),
        };
        let new_budget = (new_budget as f64 * 0.9) as u64;
        log::warn!(
            "the cache filesystem of {} is full (copying {source}, {}): evicting, and holding at most {} from now on",
            self.config.cache_dir.display(),
            human(size),
            human(new_budget)
        );
        self.effective_ssd_budget = new_budget.min(self.effective_ssd_budget);
        self.copies.failed(source.to_owned());
        self.place();
    }

    /// Starts pinning a held copy, within the RAM budget; a worker maps and locks it.
    pub(super) fn pin(&mut self, source: &str) {
        if self.pinning.has(source) {
            return;
        }
        // A partial copy is pinned by the ranges it holds, never mapped whole: the
        // mapping would fill it all.
        let (size, in_part) = self
            .cache
            .get(source)
            .map_or((0, false), |c| (c.bytes(), c.is_partial()));
        if !self.pinning.room_for(source, size, self.config.ram_budget) {
            return;
        }
        // A file inside a snapshot is pinned through the snapshot's own copy: that is
        // the inode jobs read.
        let local = self
            .snapshots
            .held(Path::new(source))
            .filter(|_| !self.snapshots.in_passage(Path::new(source)))
            .and_then(|(root, snap)| {
                Some(snap.local.join(Path::new(source).strip_prefix(root).ok()?))
            })
            .unwrap_or_else(|| self.cache.local(source));
        self.pinning.begin(source, size);
        self.workers.send(Work::Pin {
            source: source.to_owned(),
            local,
            in_part,
        });
    }

    /// A pin was made: kept if it is still wanted.
    pub(super) fn pinned(&mut self, source: String, result: std::io::Result<Mapped>) {
        let keep = self.placement.wanted(&source) == Some(true);
        if !self.pinning.made(&source, result, keep) {
            return; // unpinned meanwhile: the mapping is dropped here
        }
        if !self.settling() {
            // Prefetches that waited for their pins may be done.
            let pinned = self.pinned_now();
            self.prefetches.settled(pinned);
        }
    }

    pub(super) fn drop_copy(&mut self, source: &str) {
        self.board.withdraw(Path::new(source));
        self.jobs.detach(source);
        self.pinning.unpin(source);
        self.cache.remove(source);
        // A copy under way is discarded when it arrives.
        self.copies.end(source);
    }

    /// The tracer saw `source` change: its copy (and a snapshot holding it, unless the
    /// file is in one of its passages, which show the network itself) goes at once, and
    /// it is fetched again once stable.
    pub(super) fn invalidate(&mut self, source: String) {
        let path = Path::new(&source);
        if let Some(root) = self
            .snapshots
            .holding(path)
            .filter(|_| !self.snapshots.in_passage(path))
        {
            self.drop_snapshot(&root, &format!("{source} changed"));
            self.copies.changed(root.to_string_lossy().into_owned());
        }
        if self.cache.contains(&source) || self.copies.in_flight(&source) {
            self.status.invalidations += 1;
            log::info!("{source} changed: dropping its copy");
        }
        self.drop_copy(&source);
        self.copies.changed(source);
    }

    /// A job tried to write `source` through its read-only copy: it stays on the network.
    pub(super) fn refuse(&mut self, source: String) {
        if let Some(root) = self.snapshots.holding(Path::new(&source)) {
            self.drop_snapshot(&root, "a job tried to write in it");
        }
        self.drop_copy(&source);
        self.copies.refuse(source);
    }

    /// Asks a worker to compare what running jobs have bound with the network (one
    /// check at a time): what no job has bound is checked by the next job's start
    /// (`redirect::confirm`), so a node with no job running asks the server nothing.
    /// Of what jobs bind, what is due (`Schedule`: less often the longer it is
    /// unchanged), or with `now` all of it (a change no request could place). After a
    /// restart, every copy once: none is bound before it.
    pub(super) fn revalidate(&mut self, now: bool) {
        if self.revalidating.is_some() {
            return;
        }
        let every = self.copies.any_unverified();
        let bound = self.jobs.bound();
        let due = if now {
            Schedule::all(&bound)
        } else {
            self.schedule
                .due(&bound, Instant::now(), self.config.revalidate)
        };
        if !every && due.is_empty() {
            self.status.revalidations += 1;
            self.status.revalidations_idle += 1;
            return self.after_revalidation(false);
        }
        // A copy bound, or in a snapshot bound (whose files share its bytes).
        let checked = |p: &Path| every || p.ancestors().any(|a| due.contains(a));
        let copies: Vec<_> = self
            .cache
            .sources()
            .filter(|(s, _)| checked(Path::new(s.as_str())))
            .map(|(s, c)| (s.clone(), c.identity))
            .collect();
        let snapshots: Vec<_> = self
            .snapshots
            .stamps()
            .into_iter()
            .filter(|(root, _, _)| checked(root))
            .collect();
        if copies.is_empty() && snapshots.is_empty() {
            self.status.revalidations += 1;
            self.status.revalidations_idle += 1;
            return self.after_revalidation(false);
        }
        self.status.revalidated_entries += (copies.len() + snapshots.len()) as u64;
        self.revalidating = Some(due);
        self.workers.send(Work::Revalidate {
            copies,
            snapshots,
            trees: self.config.trees.clone(),
        });
    }

    /// What changed on the network is dropped, and fetched again once stable; what
    /// did not waits longer for its next check.
    pub(super) fn revalidated(&mut self, changed: Vec<String>, changed_trees: Vec<PathBuf>) {
        let checked = self.revalidating.take().unwrap_or_default();
        self.status.revalidations += 1;
        let at = Instant::now();
        for target in &checked {
            let hit = changed.iter().any(|c| Path::new(c).starts_with(target))
                || changed_trees
                    .iter()
                    .any(|t| t.starts_with(target) || target.starts_with(t));
            if hit {
                self.schedule.changed(target);
            } else {
                self.schedule
                    .unchanged(target, at, self.config.revalidate_max);
            }
        }
        let mut dropped = !changed_trees.is_empty();
        // Every copy from before a restart was in this check: those unchanged are
        // valid, the others dropped.
        self.copies.all_verified();
        for source in changed {
            // A copy made since the check was sent is not the one checked.
            if !self.cache.contains(&source) {
                continue;
            }
            self.status.invalidations += 1;
            dropped = true;
            log::info!(
                "{source} changed on the network: dropping its copy, fetched again once stable"
            );
            self.drop_copy(&source);
            self.copies.changed(source);
        }
        for root in changed_trees {
            self.drop_snapshot(&root, "it changed on the network");
            self.copies.changed(root.to_string_lossy().into_owned());
        }
        self.after_revalidation(dropped);
    }

    /// Places again what a check (or its interval with nothing to check) may bring
    /// back: `dropped`, whether it dropped copies.
    fn after_revalidation(&mut self, dropped: bool) {
        // Stable again ones come back. Nothing changed and nothing came back: placing a
        // site-wide profile again would decide the same (a second of work at a million
        // files), so that is done only now and then, for what waits on no event (a user
        // the name service learned of).
        let worth_it = dropped
            || self.copies.waits_over(self.config.revalidate)
            || self.placement.placed_at().elapsed() >= super::PLACE_AGAIN_ANYWAY;
        if !self.placement.shortlist().is_empty() && worth_it {
            self.place();
            self.consider_snapshots();
        }
    }

    /// New budgets (bytes); copies and pins beyond them are released.
    pub(super) fn set_budgets(&mut self, ssd: Option<u64>, ram: Option<u64>) {
        if let Some(ssd) = ssd {
            self.config.ssd_budget = ssd;
            self.effective_ssd_budget = ssd;
        }
        if let Some(ram) = ram {
            self.config.ram_budget = ram;
        }
        log::info!(
            "budgets now: SSD {}, RAM {}",
            human(self.effective_ssd_budget),
            human(self.config.ram_budget)
        );
        self.place();
    }
}
