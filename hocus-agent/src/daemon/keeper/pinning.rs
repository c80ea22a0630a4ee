//! The keeper's pins: the copies mapped and locked in RAM, and those being pinned by a
//! worker (with their size), within the RAM budget and `vm.max_map_count`.

use std::collections::HashMap;

use crate::cache::pins::{Mapped, Pins};

pub struct Pinning {
    pub pins: Pins,
    /// Pins being made: source -> size.
    pinning: HashMap<String, u64>,
}

impl Pinning {
    pub fn new() -> Self {
        Self {
            pins: Pins::new(),
            pinning: HashMap::new(),
        }
    }

    /// Whether `source` is pinned or being pinned.
    pub fn has(&self, source: &str) -> bool {
        self.pins.is_pinned(source) || self.pinning.contains_key(source)
    }

    /// Whether pins are being made (a prefetch reports what it pinned, so it waits).
    pub fn busy(&self) -> bool {
        !self.pinning.is_empty()
    }

    /// Whether a pin of `size` bytes fits the RAM budget `ram` and the mappings left;
    /// a lack of mappings is said once (`status` keeps saying it).
    pub fn room_for(&mut self, source: &str, size: u64, ram: u64) -> bool {
        let pending: u64 = self.pinning.values().sum();
        if self
            .pins
            .bytes()
            .saturating_add(pending)
            .saturating_add(size)
            > ram
        {
            return false;
        }
        let limited = self.pins.limited_by_map_count;
        match self.pins.has_room(self.pinning.len()) {
            Ok(()) => true,
            Err(e) if !limited => {
                log::warn!("cannot pin {source}: {e}");
                false
            }
            Err(_) => false,
        }
    }

    /// A worker pins `source`.
    pub fn begin(&mut self, source: &str, size: u64) {
        self.pinning.insert(source.to_owned(), size);
    }

    /// A worker mapped and locked `source`: held if `keep`; whether it was still being
    /// pinned (not unpinned meanwhile: then the mapping is dropped here).
    pub fn made(&mut self, source: &str, result: std::io::Result<Mapped>, keep: bool) -> bool {
        if self.pinning.remove(source).is_none() {
            return false;
        }
        match result {
            Ok(mapped) if keep => self.pins.hold(source, mapped),
            Ok(_) => {}
            Err(e) => log::warn!("cannot pin {source}: {e}"),
        }
        true
    }

    pub fn unpin(&mut self, source: &str) {
        self.pins.unpin(source);
        self.pinning.remove(source);
    }
}
