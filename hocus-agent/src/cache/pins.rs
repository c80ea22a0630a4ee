//! Pins: local copies mapped and mlock'ed in RAM. Locked pages survive `drop_caches` and
//! memory pressure. Only local copies are pinned, never network files (holding network
//! files mapped exhausts server handles). Each pin is one mapping, counted against
//! vm.max_map_count.

use std::{collections::HashMap, fs::File, path::Path};

use memmap2::Mmap;

/// Mappings left to the rest of the process (libraries, heap, thread stacks).
const MAPS_RESERVED: usize = 2048;

pub struct Pins {
    pinned: HashMap<String, Pin>,
    bytes: u64,
    max_maps: usize,
    /// Set once vm.max_map_count stopped a pin.
    pub limited_by_map_count: bool,
}

struct Pin {
    // Unmapped (and unlocked) when dropped.
    _map: Option<Mmap>,
    size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error(
        "vm.max_map_count allows no more mappings ({0} pins); raise it (sysctl vm.max_map_count) to pin more"
    )]
    MapCount(usize),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl Pins {
    pub fn new() -> Self {
        let max_map_count = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(65530);
        Self {
            pinned: HashMap::new(),
            bytes: 0,
            max_maps: max_map_count.saturating_sub(MAPS_RESERVED),
            limited_by_map_count: false,
        }
    }

    /// Whether another mapping fits under vm.max_map_count; remembers when not.
    pub fn has_room(&mut self, pending: usize) -> Result<(), PinError> {
        let n = self.pinned.len() + pending;
        if n >= self.max_maps {
            self.limited_by_map_count = true;
            return Err(PinError::MapCount(n));
        }
        Ok(())
    }

    /// Holds `map` (from [`map_locked`], of `size` bytes) as the pin of `source`.
    pub fn hold(&mut self, source: &str, map: Option<Mmap>, size: u64) {
        if let Some(old) = self
            .pinned
            .insert(source.to_owned(), Pin { _map: map, size })
        {
            self.bytes -= old.size;
        }
        self.bytes += size;
    }

    pub fn unpin(&mut self, source: &str) {
        if let Some(pin) = self.pinned.remove(source) {
            self.bytes -= pin.size;
        }
    }

    pub fn is_pinned(&self, source: &str) -> bool {
        self.pinned.contains_key(source)
    }

    pub fn sources(&self) -> impl Iterator<Item = &String> {
        self.pinned.keys()
    }

    pub fn len(&self) -> usize {
        self.pinned.len()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Maps and locks a local copy: its mapping (none for an empty file) and size. Faults
/// every page in from the cache's disk, so it runs on a worker, not the keeper.
pub fn map_locked(local: &Path) -> std::io::Result<(Option<Mmap>, u64)> {
    let file = File::open(local)?;
    let size = file.metadata()?.len();
    if size == 0 {
        return Ok((None, 0)); // nothing to hold
    }
    // SAFETY: the copy lives in the root-only cache; nobody but hocus changes it, and
    // hocus unpins before deleting or replacing it.
    let map = unsafe { Mmap::map(&file)? };
    map.lock()?;
    Ok((Some(map), size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_and_unpins_local_files() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::write(&a, vec![1u8; 10_000]).unwrap();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        let mut pins = Pins::new();
        let pin = |pins: &mut Pins, source: &str, local: &Path| {
            let (map, size) = map_locked(local)?;
            pins.hold(source, map, size);
            std::io::Result::Ok(())
        };
        pin(&mut pins, "/net/a", &a).unwrap();
        pin(&mut pins, "/net/a", &a).unwrap();
        pin(&mut pins, "/net/empty", &empty).unwrap();
        assert_eq!((pins.len(), pins.bytes()), (2, 10_000));
        pins.unpin("/net/a");
        assert_eq!((pins.len(), pins.bytes()), (1, 0));
        assert!(pin(&mut pins, "/net/gone", &dir.path().join("gone")).is_err());
    }
}
