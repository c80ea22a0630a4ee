//! The kernel side, from the agent: loads the eBPF programs embedded in this binary,
//! tells them where syscall arguments are (from tracefs), where kernel struct fields
//! are (from BTF) and which trees are watched, attaches them, and reads what they report.

use std::{
    os::{
        fd::{AsRawFd, OwnedFd, RawFd},
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::BtfTracePoint,
};
use hocus_common::{
    Calibration, Event, FdKey, Home, InodeKey, MAX_ROOTS, MAX_WATCHED, Mapped, NamespaceKey,
    OpenFile, Superblock, SuperblockSlot, View, counter, filter, kind, ranges::RangeRead,
    requests::RequestKey, rest, superblock,
};

use crate::{
    observe::{
        followed::Followed,
        loader::{self, Floor, Link, Loaded, SYSCALLS_PROGRAM},
        mounts,
        tripwires::Tripwire,
    },
    shared::kernel::Route,
};

/// A directory the kernel side places files under: a watched tree, or the cache's
/// copies of network files (whose paths below it are the network paths).
#[derive(Debug)]
pub struct Root {
    pub path: PathBuf,
    /// The directory, held since it was checked: what is placed under it, whatever the
    /// path leads to now.
    pub dir: OwnedFd,
    /// `superblock::WATCHED` or `superblock::CACHE`.
    pub kind: u32,
}

/// What the kernel side sends: an event, or a run of grains an open file read.
pub enum Report<'a> {
    Event(&'a Event),
    Range(RangeRead),
}

pub struct Tracer {
    // Owns the programs and their tracepoint links: dropping it detaches everything.
    ebpf: Ebpf,
    /// Each program's tracepoint links, to detach them all at once.
    links: Vec<(&'static str, Link)>,
    events: RingBuf<MapData>,
    open_files: HashMap<MapData, FdKey, OpenFile>,
    /// Files opened through watched FUSE mounts, followed by the request programs.
    request_files: HashMap<MapData, RequestKey, OpenFile>,
    /// Files opened on watched NFS mounts, followed by the NFS client's programs (by
    /// their `struct file`).
    nfs_files: HashMap<MapData, u64, OpenFile>,
    mapped: HashMap<MapData, InodeKey, Mapped>,
    counters: PerCpuArray<MapData, u64>,
    /// The processes the syscall program follows; None when it follows every process.
    followed: Option<Followed>,
    /// The roots, held open for as long as the programs run: their dentries and
    /// superblocks stay allocated, so the addresses the kernel side compares stay theirs.
    held: Vec<OwnedFd>,
    /// What the kernel side's `SUPERBLOCKS` holds, to write its slots from.
    superblocks: std::collections::HashMap<u64, Superblock>,
    /// The syscall program is detached (`rest`).
    resting: bool,
    /// Syscalls this kernel lacks, skipped.
    pub skipped: Vec<String>,
    /// The way each part of the programs takes on this kernel.
    pub routes: Vec<Route>,
    /// The tripwires tell a served job's misses apart (`loader::Loaded::tells_misses`).
    pub tells_misses: bool,
    /// Jobs are learned from the FUSE servers' requests while the syscall program rests
    /// (`loader::Loaded::learns_by_requests`).
    pub learns_by_requests: bool,
}

/// A snapshot overlay's root as the kernel side knows it.
#[derive(Debug, Clone, Copy)]
pub struct OverlayRoot {
    dentry: u64,
    superblock: u64,
}

/// Kernel-side counters, summed over CPUs, by `hocus_common::counter` index.
pub type Counters = [u64; counter::COUNT as usize];

impl Tracer {
    /// Loads and attaches the programs for the given watched prefixes (canonical paths).
    /// `every_process`: the syscall program follows every process, not only jobs and
    /// those that reached a watched mount's server (`hocus_common::follow`).
    /// `tripwires`: attached (`observe::tripwires`).
    /// Says how long that took: the kernel's verifier is most of a daemon's start.
    pub fn start(prefixes: &[&Path], every_process: bool, tripwires: &[Tripwire]) -> Result<Self> {
        let loading = std::time::Instant::now();
        let Loaded {
            mut ebpf,
            skipped,
            links,
            routes,
            tells_misses,
            learns_by_requests,
        } = loader::start(prefixes, every_process, tripwires)?;
        log::info!(
            "eBPF programs loaded and attached in {:.1} s",
            loading.elapsed().as_secs_f64()
        );
        let events = RingBuf::try_from(ebpf.take_map("EVENTS").context("no EVENTS map")?)?;
        let open_files =
            HashMap::try_from(ebpf.take_map("OPEN_FILES").context("no OPEN_FILES map")?)?;
        let request_files = HashMap::try_from(
            ebpf.take_map("REQUEST_FILES")
                .context("no REQUEST_FILES map")?,
        )?;
        let nfs_files = HashMap::try_from(ebpf.take_map("NFS_FILES").context("no NFS_FILES map")?)?;
        let mapped = HashMap::try_from(ebpf.take_map("MAPPED").context("no MAPPED map")?)?;
        let counters =
            PerCpuArray::try_from(ebpf.take_map("COUNTERS").context("no COUNTERS map")?)?;
        let followed = if every_process {
            None
        } else {
            Some(Followed::map(
                ebpf.map("FOLLOWED").context("no FOLLOWED map")?,
            )?)
        };
        Ok(Self {
            followed,
            ebpf,
            links,
            events,
            open_files,
            request_files,
            nfs_files,
            mapped,
            counters,
            held: Vec::new(),
            superblocks: std::collections::HashMap::new(),
            resting: false,
            skipped,
            routes,
            tells_misses,
            learns_by_requests,
        })
    }

    /// Attaches the floor program (returns at once) where the real ones go, until the
    /// returned value is dropped: what tracing costs before any work is done.
    pub fn floor() -> Result<Floor> {
        loader::floor()
    }

    /// Finds the roots in the kernel (through one of the agent's own syscalls on each,
    /// which the kernel side answers in `CALIBRATE`), checks the answers against `fstat`,
    /// and tells the kernel side to place files under them. Also takes the agent's own
    /// mount namespace as known. Call from one thread, before anything else is traced.
    pub fn place_under(&mut self, roots: &[Root]) -> Result<()> {
        if roots.len() > MAX_ROOTS {
            bail!(
                "at most {} trees can be watched with the cache",
                MAX_ROOTS - 2
            );
        }
        let mut table = Vec::new();
        let mut superblocks: Vec<(u64, Superblock)> = Vec::new();
        let mut namespace = None;
        for (i, root) in roots.iter().enumerate() {
            let fd = root.dir.try_clone()?;
            let c = self.calibrate(&fd)?;
            let meta = mounts::metadata_of(&fd)?;
            let dev = kernel_dev(meta.dev());
            let name = &c.name[..c.name.iter().position(|b| *b == 0).unwrap_or(c.name.len())];
            let expected = root.path.file_name().map_or(&b"/"[..], |n| n.as_bytes());
            // A filesystem's root directory is named "/" in the kernel, whatever it is
            // mounted on.
            let named = name == expected || name == b"/";
            if c.dev != dev || c.ino != meta.ino() || !named || c.dentry == 0 || c.superblock == 0 {
                bail!(
                    "the kernel's structs are not where its BTF says (hocus read device {:#x}, inode {} and name {:?} for {}, which is device {dev:#x}, inode {}): this kernel is not supported, please report it",
                    c.dev,
                    c.ino,
                    String::from_utf8_lossy(name),
                    root.path.display(),
                    meta.ino()
                );
            }
            table.push((c.dentry, i as u32));
            match superblocks.iter_mut().find(|(sb, _)| *sb == c.superblock) {
                Some((_, known)) => known.flags |= root.kind,
                None => superblocks.push((
                    c.superblock,
                    Superblock {
                        flags: root.kind,
                        root: c.superblock_root,
                        ..Default::default()
                    },
                )),
            }
            namespace = Some(c.namespace);
            self.held.push(fd);
        }
        // The working directory and the root directory are read at other offsets:
        // checked the same way, against descriptors of "." and "/".
        let (cwd, slash) = (
            mounts::open_dir(Path::new("."))?,
            mounts::open_dir(Path::new("/"))?,
        );
        let (c_cwd, c_slash) = (self.calibrate(&cwd)?, self.calibrate(&slash)?);
        if c_cwd.cwd != c_cwd.dentry || c_slash.namespace.root != c_slash.dentry {
            bail!(
                "the kernel's structs are not where its BTF says (working directory or root did not match): this kernel is not supported, please report it"
            );
        }
        let namespace = namespace.unwrap_or(c_slash.namespace);
        if namespace.namespace == 0 {
            bail!("the kernel side could not read the agent's mount namespace");
        }
        let mut roots_map: HashMap<_, u64, u32> =
            HashMap::try_from(self.ebpf.map_mut("ROOTS").context("no ROOTS map")?)?;
        for (dentry, index) in table {
            roots_map.insert(dentry, index, 0)?;
        }
        for (sb, known) in superblocks {
            self.know_superblock(sb, known)?;
        }
        let mut known: HashMap<_, NamespaceKey, u32> = HashMap::try_from(
            self.ebpf
                .map_mut("KNOWN_NAMESPACES")
                .context("no KNOWN_NAMESPACES map")?,
        )?;
        known.insert(namespace, 1, 0)?;
        let mut home: Array<_, Home> =
            Array::try_from(self.ebpf.map_mut("HOME").context("no HOME map")?)?;
        home.set(
            0,
            Home {
                nsproxy: c_slash.nsproxy,
                root: c_slash.namespace.root,
            },
            0,
        )?;
        Ok(())
    }

    /// Places files opened under the snapshot overlay `overlay` (the root of an overlay hocus
    /// mounted in a job's namespace) as `Event::root` `index`, until forgotten. The
    /// caller keeps `overlay` open meanwhile: its dentry and superblock stay allocated, so
    /// the addresses stay theirs.
    pub fn add_overlay_root(&mut self, overlay: &OwnedFd, index: u32) -> Result<OverlayRoot> {
        let c = self.calibrate(overlay)?;
        if c.dentry == 0 || c.superblock == 0 {
            bail!("the kernel side could not read the overlay's root");
        }
        let root = OverlayRoot {
            dentry: c.dentry,
            superblock: c.superblock,
        };
        self.know_superblock(
            root.superblock,
            Superblock {
                flags: superblock::SNAPSHOT_OVERLAY,
                root: c.superblock_root,
                ..Default::default()
            },
        )?;
        let mut roots: HashMap<_, u64, u32> =
            HashMap::try_from(self.ebpf.map_mut("ROOTS").context("no ROOTS map")?)?;
        if let Err(e) = roots.insert(root.dentry, index, 0) {
            self.remove_overlay_root(&root);
            return Err(e.into());
        }
        Ok(root)
    }

    pub fn remove_overlay_root(&mut self, root: &OverlayRoot) {
        if let Some(Ok(mut roots)) = self
            .ebpf
            .map_mut("ROOTS")
            .map(HashMap::<_, u64, u32>::try_from)
        {
            let _ = roots.remove(&root.dentry);
        }
        let _ = self.forget_superblock(root.superblock);
    }

    /// Tells the kernel side superblock `sb` is one to look at.
    fn know_superblock(&mut self, sb: u64, known: Superblock) -> Result<()> {
        let mut map: HashMap<_, u64, Superblock> = HashMap::try_from(
            self.ebpf
                .map_mut("SUPERBLOCKS")
                .context("no SUPERBLOCKS map")?,
        )?;
        map.insert(sb, known, 0)?;
        self.superblocks.insert(sb, known);
        self.write_superblock_slot(filter::superblock_slot(sb))
    }

    fn forget_superblock(&mut self, sb: u64) -> Result<()> {
        let mut map: HashMap<_, u64, Superblock> = HashMap::try_from(
            self.ebpf
                .map_mut("SUPERBLOCKS")
                .context("no SUPERBLOCKS map")?,
        )?;
        let _ = map.remove(&sb);
        self.superblocks.remove(&sb);
        self.write_superblock_slot(filter::superblock_slot(sb))
    }

    /// Rewrites slot `slot` of `SUPERBLOCK_SLOTS` from the agent's own list: how many
    /// superblocks fall in it, and the one, if one.
    fn write_superblock_slot(&mut self, slot: u32) -> Result<()> {
        let mut here = self
            .superblocks
            .iter()
            .filter(|(sb, _)| filter::superblock_slot(**sb) == slot);
        let count = here.clone().count() as u32;
        let mut value = SuperblockSlot {
            count,
            ..Default::default()
        };
        if let (1, Some((sb, known))) = (count, here.next()) {
            value.address = *sb;
            value.superblock = *known;
        }
        let mut slots: Array<_, SuperblockSlot> = Array::try_from(
            self.ebpf
                .map_mut("SUPERBLOCK_SLOTS")
                .context("no SUPERBLOCK_SLOTS map")?,
        )?;
        slots.set(slot, value, 0)?;
        Ok(())
    }

    /// Counts a descriptor the agent forgot in `RELEASED` (the agent is its only
    /// writer), so that the kernel side's filter still adds up.
    fn count_released(&mut self, key: &FdKey) -> Result<()> {
        let slot = filter::process_slot(key.tgid);
        let mut released: Array<_, u32> =
            Array::try_from(self.ebpf.map_mut("RELEASED").context("no RELEASED map")?)?;
        let n = released.get(&slot, 0)?;
        released.set(slot, n.wrapping_add(1), 0)?;
        Ok(())
    }

    /// How many times a mount has started or ended: a view learned before is stale.
    pub fn mount_generation(&self) -> Result<u64> {
        let map: Array<_, u64> = Array::try_from(
            self.ebpf
                .map("MOUNT_GENERATION")
                .context("no MOUNT_GENERATION map")?,
        )?;
        Ok(map.get(&0, 0)?)
    }

    /// Gives the kernel side another namespace's view, and forgets one.
    pub fn set_view(
        &mut self,
        key: NamespaceKey,
        view: View,
        forget: Option<NamespaceKey>,
    ) -> Result<()> {
        let mut views: HashMap<_, NamespaceKey, View> =
            HashMap::try_from(self.ebpf.map_mut("VIEWS").context("no VIEWS map")?)?;
        views.insert(key, view, 0)?;
        if let Some(old) = forget {
            let _ = views.remove(&old);
        }
        Ok(())
    }

    /// Asks the kernel side what the agent's descriptor `fd` is open on.
    fn calibrate(&mut self, fd: &OwnedFd) -> Result<Calibration> {
        let mut map: Array<_, Calibration> =
            Array::try_from(self.ebpf.map_mut("CALIBRATE").context("no CALIBRATE map")?)?;
        // SAFETY: no arguments.
        let tid = unsafe { libc::gettid() } as u64;
        let ask = Calibration {
            thread: (u64::from(std::process::id()) << 32) | tid,
            fd: fd.as_raw_fd(),
            ..Default::default()
        };
        map.set(0, ask, 0)?;
        // Any traced path syscall of this thread is answered: fstatat on the descriptor.
        // SAFETY: valid descriptor, empty path, a stat buffer of the right size.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            libc::fstatat(fd.as_raw_fd(), c"".as_ptr(), &mut st, libc::AT_EMPTY_PATH);
        }
        let answer = map.get(&0, 0)?;
        map.set(0, Calibration::default(), 0)?;
        if answer.done == 0 {
            bail!("the kernel side did not answer the agent's calibration (is newfstatat traced?)");
        }
        Ok(answer)
    }

    /// Detaches the programs: nothing more is traced. The maps stay readable.
    pub fn detach(&mut self) {
        let t0 = std::time::Instant::now();
        for (name, link) in std::mem::take(&mut self.links) {
            if let Err(e) = loader::detach(&mut self.ebpf, name, link) {
                log::warn!("could not detach {name}: {e:#}");
            }
        }
        log::debug!("tracepoint links detached in {:?}", t0.elapsed());
    }

    /// Tells the kernel side the watched mounts' devices (`st_dev`): activity on them
    /// wakes the syscall program while it rests.
    pub fn watch_devices(&mut self, devices: &[u64]) -> Result<()> {
        let mut table: Array<_, u32> = Array::try_from(
            self.ebpf
                .map_mut("WATCHED_DEVICES")
                .context("no WATCHED_DEVICES map")?,
        )?;
        for (i, dev) in devices.iter().take(MAX_WATCHED as usize).enumerate() {
            table.set(i as u32, kernel_dev(*dev), 0)?;
        }
        Ok(())
    }

    /// Detaches the syscall program: no process on the node pays for tracing until the
    /// tripwires (a request to a watched FUSE mount, pages read into a watched mount's
    /// page cache) or `wake` attach it again. What processes do meanwhile is not seen.
    /// `with_jobs`: jobs run whose requests all hit local copies; only a request that
    /// reads or changes a watched mount wakes it (`hocus_common::rest`). Where the
    /// request programs learn, jobs or not, no tripwire wakes it.
    pub fn rest(&mut self, with_jobs: bool) -> Result<()> {
        if self.resting {
            return Ok(());
        }
        let Some(at) = self.links.iter().position(|(n, _)| *n == SYSCALLS_PROGRAM) else {
            bail!("the syscall program is not attached");
        };
        let (name, link) = self.links.remove(at);
        loader::detach(&mut self.ebpf, name, link)?;
        // Detached first: a tripwire that fires before this only wakes it again.
        self.set_rest(if self.learns_by_requests {
            rest::LEARNING_BY_REQUESTS
        } else if with_jobs {
            rest::RESTING_WITH_JOBS
        } else {
            rest::RESTING
        })?;
        self.resting = true;
        Ok(())
    }

    /// The jobs that ran at rest have ended: any use of a watched mount wakes it again.
    pub fn rest_without_jobs(&mut self) -> Result<()> {
        let map: Array<_, u32> = Array::try_from(self.ebpf.map("REST").context("no REST map")?)?;
        if self.resting && map.get(&0, 0)? == rest::RESTING_WITH_JOBS {
            self.set_rest(rest::RESTING)?;
        }
        Ok(())
    }

    /// Attaches the syscall program again after `rest`.
    pub fn wake(&mut self) -> Result<()> {
        if !self.resting {
            return Ok(());
        }
        let name = SYSCALLS_PROGRAM;
        let program: &mut BtfTracePoint = self
            .ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?
            .try_into()?;
        // Loaded (and verified) at start: attaching is all there is to do.
        let link = program
            .attach()
            .with_context(|| format!("attaching {name} again"))?;
        self.links.push((name, Link::Btf(link)));
        self.resting = false;
        self.set_rest(rest::AWAKE)?;
        // Mounts made while it rested were not seen: the views learned before are stale.
        let mut generation: Array<_, u64> = Array::try_from(
            self.ebpf
                .map_mut("MOUNT_GENERATION")
                .context("no MOUNT_GENERATION map")?,
        )?;
        let g = generation.get(&0, 0)?;
        generation.set(0, g + 1, 0)?;
        Ok(())
    }

    pub fn is_resting(&self) -> bool {
        self.resting
    }

    fn set_rest(&mut self, state: u32) -> Result<()> {
        let mut map: Array<_, u32> =
            Array::try_from(self.ebpf.map_mut("REST").context("no REST map")?)?;
        map.set(0, state, 0)?;
        Ok(())
    }

    /// Passes everything waiting to `f`, in the order the kernel reserved it.
    pub fn drain(&mut self, mut f: impl FnMut(Report)) -> usize {
        let mut n = 0;
        while let Some(item) = self.events.next() {
            if item.len() == size_of::<RangeRead>() && item[0] == kind::RANGE {
                // SAFETY: the kernel wrote a whole `RangeRead` (checked length and kind);
                // it may be unaligned.
                let run = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<RangeRead>()) };
                f(Report::Range(run));
            } else if item.len() >= size_of::<Event>() {
                // SAFETY: the kernel wrote a whole `Event` (checked length); it may be
                // unaligned.
                let event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<Event>()) };
                f(Report::Event(&event));
            } else {
                continue;
            }
            n += 1;
        }
        n
    }

    /// The watched files processes have open now, with what they have read so far (an
    /// entry whose file is 0 was closed, its close reported).
    pub fn open_files(&self) -> Vec<(FdKey, OpenFile)> {
        self.open_files
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, f)| f.file != 0)
            .collect()
    }

    /// The files the request programs (FUSE's and the NFS client's) follow, with what
    /// each read so far. Both are open files the sweep must not take for lost: a job
    /// that holds one longer than two sweeps still reads it.
    pub fn request_files(&self) -> Vec<OpenFile> {
        let fuse = self
            .request_files
            .iter()
            .filter_map(|e| e.ok().map(|(_, f)| f));
        let nfs = self.nfs_files.iter().filter_map(|e| e.ok().map(|(_, f)| f));
        fuse.chain(nfs).collect()
    }

    /// The watched files processes mapped, with the pages that entered their page cache
    /// since.
    pub fn mapped_files(&self) -> Vec<(InodeKey, Mapped)> {
        self.mapped.iter().filter_map(Result::ok).collect()
    }

    /// Counts process `pid` (and whatever it forks from now on) as job `job`: a process
    /// the daemon did not fork (an attached Slurm task). It is followed from now on.
    pub fn mark_job(&mut self, pid: u32, job: u32) -> Result<()> {
        let mut jobs: HashMap<_, u32, u32> =
            HashMap::try_from(self.ebpf.map_mut("JOBS").context("no JOBS map")?)?;
        jobs.insert(pid, job, 0)?;
        self.followed.as_ref().map_or(Ok(()), |f| f.follow(pid))
    }

    /// The processes the syscall program follows; None if it follows every process.
    pub fn followed(&self) -> Option<&Followed> {
        self.followed.as_ref()
    }

    pub fn forget_mapped(&mut self, key: &InodeKey) {
        let _ = self.mapped.remove(key);
    }

    /// Forgets a process's watched descriptor (the process is gone).
    pub fn forget_open_file(&mut self, key: &FdKey) {
        if self.open_files.remove(key).is_ok() {
            // Uncounted, the filter only looks its slot's descriptors up for nothing.
            if let Err(e) = self.count_released(key) {
                log::warn!("could not count a released descriptor: {e:#}");
            }
        }
    }

    pub fn counters(&self) -> Result<Counters> {
        let mut out = [0u64; counter::COUNT as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            let per_cpu = self.counters.get(&(i as u32), 0)?;
            *slot = per_cpu.iter().sum();
        }
        Ok(out)
    }
}

impl AsRawFd for Tracer {
    /// The ring buffer's descriptor: readable when the kernel wakes us.
    fn as_raw_fd(&self) -> RawFd {
        self.events.as_raw_fd()
    }
}

/// A device number as the kernel keeps it (`s_dev`: major << 20 | minor).
fn kernel_dev(dev: u64) -> u32 {
    (libc::major(dev) << 20) | libc::minor(dev)
}
