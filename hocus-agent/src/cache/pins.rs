//! Pins: local copies mapped and mlock'ed in RAM. Locked pages survive `drop_caches` and
//! memory pressure. Only local copies are pinned, never network files (holding network
//! files mapped exhausts server handles). A whole copy is one mapping; a copy held in
//! part is one per range it holds, never its holes. Mappings count against
//! vm.max_map_count.

use std::{collections::HashMap, fs::File, path::Path};

use memmap2::{Mmap, MmapOptions};

use crate::cache::partial::held_grains;

/// Mappings left to the rest of the process (libraries, heap, thread stacks).
const MAPS_RESERVED: usize = 2048;

pub struct Pins {
    pinned: HashMap<String, Mapped>,
    bytes: u64,
    /// Mappings the pins hold.
    maps: usize,
    max_maps: usize,
    /// Set once vm.max_map_count stopped a pin.
    pub limited_by_map_count: bool,
}

/// A copy's mappings, locked (unmapped and unlocked when dropped), and their bytes.
#[derive(Default)]
pub struct Mapped {
    maps: Vec<Mmap>,
    pub bytes: u64,
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
            maps: 0,
            max_maps: max_map_count.saturating_sub(MAPS_RESERVED),
            limited_by_map_count: false,
        }
    }

    /// Whether another mapping fits under vm.max_map_count; remembers when not.
    pub fn has_room(&mut self, pending: usize) -> Result<(), PinError> {
        let n = self.maps + pending;
        if n >= self.max_maps {
            self.limited_by_map_count = true;
            return Err(PinError::MapCount(n));
        }
        Ok(())
    }

    /// Holds `mapped` (from [`map_locked`]) as the pin of `source`.
    pub fn hold(&mut self, source: &str, mapped: Mapped) {
        (self.bytes, self.maps) = (self.bytes + mapped.bytes, self.maps + mapped.maps.len());
        if let Some(old) = self.pinned.insert(source.to_owned(), mapped) {
            self.forget(&old);
        }
    }

    pub fn unpin(&mut self, source: &str) {
        if let Some(pin) = self.pinned.remove(source) {
            self.forget(&pin);
        }
    }

    fn forget(&mut self, pin: &Mapped) {
        (self.bytes, self.maps) = (self.bytes - pin.bytes, self.maps - pin.maps.len());
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

/// Maps and locks a local copy: whole, or for a copy held in part (`in_part`) each
/// range of whole grains it holds (what jobs read and fills added: its hot ranges). A
/// mapping of a hole would ask its fill from the network at `mmap`. Faults every page in
/// from the cache's disk, so it runs on a worker, not the keeper.
pub fn map_locked(local: &Path, in_part: bool) -> std::io::Result<Mapped> {
    let file = File::open(local)?;
    let size = file.metadata()?.len();
    let ranges = if in_part {
        held_grains(&file, size)?.to_bytes(size)
    } else {
        vec![[0, size]]
    };
    let mut mapped = Mapped::default();
    for [start, end] in ranges.into_iter().filter(|[s, e]| s < e) {
        // SAFETY: the copy lives in the root-only cache; nobody but hocus changes it, and
        // hocus unpins before deleting or replacing it.
        let map = unsafe {
            MmapOptions::new()
                .offset(start)
                .len((end - start) as usize)
                .map(&file)?
        };
        map.lock()?;
        mapped.maps.push(map);
        mapped.bytes += end - start;
    }
    Ok(mapped)
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
            pins.hold(source, map_locked(local, false)?);
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

    #[test]
    fn a_copy_held_in_part_is_pinned_by_the_ranges_it_holds_only() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("part");
        // 4 MiB, holding grains 2..4 and the short last one (a grain is 64 KiB).
        let size = (4 << 20) + 1000;
        let f = File::create(&part).unwrap();
        f.set_len(size).unwrap();
        f.write_at(&[7u8; 128 << 10], 128 << 10).unwrap();
        f.write_at(&[9u8; 1000], 4 << 20).unwrap();
        f.sync_all().unwrap();
        let blocks = std::fs::metadata(&part).unwrap().blocks();
        let mapped = map_locked(&part, true).unwrap();
        assert_eq!(mapped.maps.len(), 2);
        assert_eq!(mapped.bytes, (128 << 10) + 1000);
        assert!(mapped.maps[0].iter().all(|b| *b == 7));
        assert!(mapped.maps[1].iter().all(|b| *b == 9));
        // Its holes were not touched.
        assert_eq!(std::fs::metadata(&part).unwrap().blocks(), blocks);
        let mut pins = Pins::new();
        pins.hold("/net/part", mapped);
        pins.hold("/net/part", map_locked(&part, false).unwrap());
        assert_eq!((pins.len(), pins.maps, pins.bytes()), (1, 1, size));
        pins.unpin("/net/part");
        assert_eq!((pins.maps, pins.bytes()), (0, 0));
    }
}
