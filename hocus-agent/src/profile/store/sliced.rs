//! A snapshot written a slice at a time, so that the daemon's loop never stops for a
//! million entries (issue 36: no request waits behind the daemon's own work). The loop
//! encodes a slice of entries per turn ([`Sliced::next_slice`]); a thread of its own
//! writes them to the temporary file, fsyncs and renames it. The working set changes in
//! between: what changed is marked, and the first journal after the snapshot holds it.
//! Until the snapshot is in place nothing is appended (the old snapshot and journal
//! stay whole, so a crash meanwhile loses no more than a save interval).

use std::{
    io::{self, Write},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
};

use anyhow::{Context, Result};

use super::{
    STATE_MAGIC, StateDir,
    codec::{END, encode, frame},
};
use crate::{
    profile::working_set::{Pass, WorkingSet},
    shared::replace::write_replacing,
};

/// Slices encoded ahead of the writer at most.
const AHEAD: usize = 4;
/// Entries a slice holds: ~400 KiB, ~8 ms of the loop's time (~2 µs an entry).
pub const SLICE: usize = 4_096;

/// A snapshot being written: see the module's comment.
pub struct Sliced {
    generation: u64,
    pass: Pass,
    count: u64,
    /// Every entry and the end record are encoded.
    encoded: bool,
    /// Encoded, not yet taken by the writer (it was behind).
    waiting: Option<Vec<u8>>,
    /// To the writer; dropped once all is handed over, which ends the file.
    slices: Option<mpsc::SyncSender<Vec<u8>>>,
    /// Set when it is dropped unfinished: the writer then leaves the old snapshot.
    given_up: Arc<AtomicBool>,
    /// The writer's result: the snapshot's size.
    written: mpsc::Receiver<io::Result<u64>>,
}

impl StateDir {
    /// Starts writing the whole of `ws` as the next generation's snapshot; the loop then
    /// calls [`Sliced::next_slice`] until it says it is done, and [`StateDir::sliced_done`]
    /// with its [`Sliced::result`].
    pub fn begin_sliced(&mut self, ws: &WorkingSet) -> Result<Sliced> {
        let generation = self.generation + 1;
        let path = self.profile_path();
        let mut head = Vec::with_capacity(24);
        head.extend_from_slice(STATE_MAGIC);
        head.extend_from_slice(&generation.to_le_bytes());
        head.extend_from_slice(&ws.started_unix_ns.to_le_bytes());
        let (slices, from_loop) = mpsc::sync_channel::<Vec<u8>>(AHEAD);
        let (report, written) = mpsc::channel();
        let given_up = Arc::new(AtomicBool::new(false));
        let gave_up = given_up.clone();
        thread::Builder::new()
            .name("hocus-save".into())
            .spawn(move || {
                let result = write_replacing(&path, |w| {
                    w.write_all(&head)?;
                    for slice in from_loop {
                        w.write_all(&slice)?;
                    }
                    if gave_up.load(Ordering::Acquire) {
                        // The daemon stopped short of the end: the old one stays.
                        return Err(io::Error::other("the snapshot was given up"));
                    }
                    Ok(())
                });
                let _ = report.send(result.map(|((), bytes)| bytes));
            })
            .context("starting the thread that saves the profile")?;
        self.slicing = true;
        Ok(Sliced {
            generation,
            pass: ws.pass(),
            count: 0,
            encoded: false,
            waiting: None,
            slices: Some(slices),
            given_up,
            written,
        })
    }

    /// The writer finished `sliced` with `result`: on success the snapshot is in place,
    /// and the journal it replaces is removed; on failure the next save of `ws` writes
    /// everything.
    pub fn sliced_done(
        &mut self,
        sliced: &Sliced,
        result: io::Result<u64>,
        ws: &mut WorkingSet,
    ) -> Result<()> {
        self.slicing = false;
        match result {
            Ok(bytes) => {
                self.snapshot_in_place(sliced.generation, bytes);
                Ok(())
            }
            Err(e) => {
                ws.all_changed();
                Err(e).with_context(|| format!("saving the profile in {}", self.dir.display()))
            }
        }
    }
}

impl Sliced {
    /// Encodes up to `n` more entries and hands them to the writer, unless it is
    /// behind; whether there is more to do (else wait for [`Sliced::result`]).
    pub fn next_slice(&mut self, ws: &WorkingSet, n: usize) -> bool {
        let Some(slices) = &self.slices else {
            return false;
        };
        if self.waiting.is_none() && !self.encoded {
            let mut buf = Vec::new();
            let mut count = 0;
            let more = ws.next_entries(&mut self.pass, n, |e| {
                frame(&mut buf, |b| encode(b, &e));
                count += 1;
            });
            self.count += count;
            if !more {
                // The end: a record of the count, so that a cut file is never taken as
                // whole.
                frame(&mut buf, |b| {
                    b.push(END);
                    b.extend_from_slice(&self.count.to_le_bytes());
                });
                self.encoded = true;
            }
            self.waiting = Some(buf);
        }
        if let Some(slice) = self.waiting.take() {
            match slices.try_send(slice) {
                Ok(()) => {}
                Err(mpsc::TrySendError::Full(slice)) => {
                    self.waiting = Some(slice);
                    return true;
                }
                // The writer failed: its result says why.
                Err(mpsc::TrySendError::Disconnected(_)) => {
                    self.slices = None;
                    return false;
                }
            }
        }
        if self.encoded {
            // All handed over: closing the channel ends the file.
            self.slices = None;
            return false;
        }
        true
    }

    /// Whether slices are left to hand over.
    pub fn handing_over(&self) -> bool {
        self.slices.is_some()
    }

    /// The writer's result, once all is handed over and it has finished.
    pub fn result(&self) -> Option<io::Result<u64>> {
        if self.slices.is_some() {
            return None;
        }
        match self.written.try_recv() {
            Ok(result) => Some(result),
            Err(mpsc::TryRecvError::Empty) => None,
            // It panicked: the snapshot is not in place, and the next save tries again.
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(ended())),
        }
    }

    /// Encodes what is left, waiting for the writer when it is behind, and waits for its
    /// result (the daemon stops).
    pub fn finish(&mut self, ws: &WorkingSet) -> io::Result<u64> {
        while self.next_slice(ws, SLICE) {
            if let (Some(slices), Some(slice)) = (&self.slices, self.waiting.take()) {
                if slices.send(slice).is_err() {
                    self.slices = None;
                }
            }
        }
        self.written.recv().unwrap_or_else(|_| Err(ended()))
    }
}

fn ended() -> io::Error {
    io::Error::other("the thread saving the profile ended without a word")
}

impl Drop for Sliced {
    fn drop(&mut self) {
        if !self.encoded {
            self.given_up.store(true, Ordering::Release);
        }
    }
}
