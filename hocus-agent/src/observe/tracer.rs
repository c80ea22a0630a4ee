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
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{
        BtfTracePoint, TracePoint, tp_btf::BtfTracePointLinkId, trace_point::TracePointLinkId,
    },
};
use hocus_common::{
    Calibration, Event, FdKey, Home, InodeKey, MAX_PREFIX, MAX_ROOTS, MAX_TREES, MAX_WATCHED,
    Mapped, NamespaceKey, OpenFile, Superblock, SuperblockSlot, SyscallLayout, View, Watched,
    counter, filter, kfunc, rest, superblock,
};

use crate::observe::{
    btf::{self, Btf},
    followed::Followed,
    kfuncs, mounts, syscalls, tracefs,
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

pub struct Tracer {
    // Owns the programs and their tracepoint links: dropping it detaches everything.
    ebpf: Ebpf,
    /// Each program's tracepoint links, to detach them all at once.
    links: Vec<(&'static str, Link)>,
    events: RingBuf<MapData>,
    open_files: HashMap<MapData, FdKey, OpenFile>,
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
}

/// The programs and where each is attached. Syscalls are seen at one place, their exit
/// (`tp_btf/sys_exit`), by one program dispatching on the syscall number: the
/// per-syscall tracepoints (`syscalls:sys_enter_openat` ...) make the kernel build a
/// record for every traced syscall of every process before any program runs, and a
/// program at the entry too would run for every syscall on the node a second time
/// (docs/overhead.md). Pages entering the page cache are counted for mapped watched
/// files.
const PROGRAMS: [(&str, Attach); 4] = [
    (SYSCALLS_PROGRAM, Attach::Btf("sys_exit")),
    ("process_fork", Attach::Event("sched", "sched_process_fork")),
    ("process_exit", Attach::Event("sched", "sched_process_exit")),
    (
        "filemap_add",
        Attach::Event("filemap", "mm_filemap_add_to_page_cache"),
    ),
];

/// The program that rests while there is nothing to learn (`Tracer::rest`).
const SYSCALLS_PROGRAM: &str = "syscall_exit";

/// A tripwire for resting: requests to FUSE filesystems (sshfs ...), where the kernel
/// has the tracepoint; other filesystems never reach it.
const FUSE_TRIPWIRE: (&str, Attach) = ("fuse_request", Attach::Event("fuse", "fuse_request_send"));

/// What `hocus-agent trace-floor` attaches: a program that returns at once, where the
/// syscall program goes. What any design there costs, for `cargo xtask bench overhead`.
const FLOOR: [(&str, Attach); 1] = [("floor", Attach::Btf("sys_exit"))];

/// The floor program, attached while this lives (the links belong to the programs).
pub struct Floor {
    _programs: Ebpf,
}

#[derive(Clone, Copy)]
enum Attach {
    /// A BTF-typed tracepoint (`tp_btf`), by name: its arguments are typed pointers, and
    /// the fields the program reads through them are plain loads, not helper calls.
    Btf(&'static str),
    /// A tracepoint, by category and name.
    Event(&'static str, &'static str),
}

enum Link {
    Btf(BtfTracePointLinkId),
    Event(TracePointLinkId),
}

/// A snapshot view's root as the kernel side knows it.
#[derive(Debug, Clone, Copy)]
pub struct ViewRoot {
    dentry: u64,
    superblock: u64,
}

/// Programs loaded and attached: whether they cast files, the syscalls not traced, and
/// the links.
type Started = (Ebpf, bool, Vec<String>, Vec<(&'static str, Link)>);

/// Kernel-side counters, summed over CPUs, by `hocus_common::counter` index.
pub type Counters = [u64; counter::COUNT as usize];

impl Tracer {
    /// Loads and attaches the programs for the given watched prefixes (canonical paths).
    /// `every_process`: the syscall program follows every process, not only jobs and
    /// those that reached a watched mount's server (`hocus_common::follow`).
    pub fn start(prefixes: &[&Path], every_process: bool) -> Result<Self> {
        let tracefs = tracefs::root()?;
        let start = |kfuncs| -> Result<Started> {
            let (mut ebpf, cast) = load(&tracefs, every_process, kfuncs)?;
            let skipped = fill_tables(&mut ebpf, &tracefs, prefixes)?;
            let links = attach(&mut ebpf, &PROGRAMS)
                .map_err(|e| if cast { e.context(KfuncsRefused) } else { e })?;
            Ok((ebpf, cast, skipped, links))
        };
        // A kernel whose verifier refuses the kfunc calls still gets the programs.
        let name = kfunc::RDONLY_CAST_NAME;
        let kfuncs = kfuncs_allowed();
        let mut without = if kfuncs {
            format!("this kernel has no {name}: before 6.2")
        } else {
            format!("{WITHOUT_KFUNCS}=1")
        };
        let (mut ebpf, cast, skipped, mut links) = match start(kfuncs) {
            Err(e) if e.downcast_ref::<KfuncsRefused>().is_some() => {
                log::warn!("{e:#}; loading them without");
                without = format!("the kernel refused {name}");
                start(false)?
            }
            started => started?,
        };
        if cast {
            log::info!("the programs read open files with plain loads ({name})");
        } else {
            log::info!("the programs read open files with a helper call each ({without})");
        }
        if tracefs.join("events/fuse/fuse_request_send").exists() {
            links.extend(attach(&mut ebpf, &[FUSE_TRIPWIRE])?);
        }
        let events = RingBuf::try_from(ebpf.take_map("EVENTS").context("no EVENTS map")?)?;
        let open_files =
            HashMap::try_from(ebpf.take_map("OPEN_FILES").context("no OPEN_FILES map")?)?;
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
            mapped,
            counters,
            held: Vec::new(),
            superblocks: std::collections::HashMap::new(),
            resting: false,
            skipped,
        })
    }

    /// Attaches the floor program (returns at once) where the real ones go, until the
    /// returned value is dropped: what tracing costs before any work is done.
    pub fn floor() -> Result<Floor> {
        let (mut ebpf, _) = load(&tracefs::root()?, false, false)?;
        attach(&mut ebpf, &FLOOR)?;
        Ok(Floor { _programs: ebpf })
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

    /// Places files opened under the snapshot view `view` (the root of an overlay hocus
    /// mounted in a job's namespace) as `Event::root` `index`, until forgotten. The
    /// caller keeps `view` open meanwhile: its dentry and superblock stay allocated, so
    /// the addresses stay theirs.
    pub fn add_view_root(&mut self, view: &OwnedFd, index: u32) -> Result<ViewRoot> {
        let c = self.calibrate(view)?;
        if c.dentry == 0 || c.superblock == 0 {
            bail!("the kernel side could not read the view's root");
        }
        let root = ViewRoot {
            dentry: c.dentry,
            superblock: c.superblock,
        };
        self.know_superblock(
            root.superblock,
            Superblock {
                flags: superblock::SNAPSHOT_VIEW,
                root: c.superblock_root,
                ..Default::default()
            },
        )?;
        let mut roots: HashMap<_, u64, u32> =
            HashMap::try_from(self.ebpf.map_mut("ROOTS").context("no ROOTS map")?)?;
        if let Err(e) = roots.insert(root.dentry, index, 0) {
            self.remove_view_root(&root);
            return Err(e.into());
        }
        Ok(root)
    }

    pub fn remove_view_root(&mut self, root: &ViewRoot) {
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
            if let Err(e) = self.detach_link(name, link) {
                log::warn!("could not detach {name}: {e:#}");
            }
        }
        log::debug!("tracepoint links detached in {:?}", t0.elapsed());
    }

    fn detach_link(&mut self, name: &str, link: Link) -> Result<()> {
        let program = self
            .ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?;
        match link {
            Link::Btf(id) => <&mut BtfTracePoint>::try_from(program)?.detach(id)?,
            Link::Event(id) => <&mut TracePoint>::try_from(program)?.detach(id)?,
        }
        Ok(())
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
    pub fn rest(&mut self) -> Result<()> {
        if self.resting {
            return Ok(());
        }
        let Some(at) = self.links.iter().position(|(n, _)| *n == SYSCALLS_PROGRAM) else {
            bail!("the syscall program is not attached");
        };
        let (name, link) = self.links.remove(at);
        self.detach_link(name, link)?;
        // Detached first: a tripwire that fires before this only wakes it again.
        self.set_rest(rest::RESTING)?;
        self.resting = true;
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

    /// Passes every waiting event to `f`, in the order the kernel reserved them.
    pub fn drain(&mut self, mut f: impl FnMut(&Event)) -> usize {
        let mut n = 0;
        while let Some(item) = self.events.next() {
            if item.len() < size_of::<Event>() {
                continue;
            }
            // SAFETY: the kernel wrote a whole `Event` (checked length); it may be unaligned.
            let event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<Event>()) };
            f(&event);
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

/// Which of each syscall's arguments are read, by syscall number, and the watched
/// prefixes. Returns the syscalls this kernel cannot trace.
fn fill_tables(ebpf: &mut Ebpf, tracefs: &Path, prefixes: &[&Path]) -> Result<Vec<String>> {
    let mut table: Array<_, SyscallLayout> =
        Array::try_from(ebpf.map_mut("SYSCALLS").context("no SYSCALLS map")?)?;
    let mut skipped = Vec::new();
    for t in syscalls::all() {
        match t.layout(tracefs) {
            Ok(layout) => table.set(t.nr as u32, layout, 0)?,
            Err(e) => {
                log::warn!("not tracing {}: {e:#}", t.name);
                skipped.push(t.name.to_owned());
            }
        }
    }
    let mut table: Array<_, Watched> =
        Array::try_from(ebpf.map_mut("WATCHED").context("no WATCHED map")?)?;
    for (i, entry) in prefix_table(prefixes)?.into_iter().enumerate() {
        table.set(i as u32, entry, 0)?;
    }
    Ok(skipped)
}

/// The verifier refused the programs with their kfunc calls.
#[derive(Debug)]
struct KfuncsRefused;

impl std::fmt::Display for KfuncsRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the kernel refused the programs' kfunc calls")
    }
}

/// The environment variable that makes the agent load its programs as for a kernel
/// without kfuncs: the tests take that way too; and a way round a kernel whose kfunc
/// misbehaves.
pub const WITHOUT_KFUNCS: &str = "HOCUS_WITHOUT_KFUNCS";

fn kfuncs_allowed() -> bool {
    std::env::var_os(WITHOUT_KFUNCS).is_none_or(|v| v != "1")
}

/// Loads the programs embedded in this binary, with the kernel's struct offsets (from
/// its BTF) and the agent's own process id set; `kfuncs`: calling kfuncs where the
/// kernel has them. Returns whether the programs cast files (`kfunc::RDONLY_CAST`).
fn load(tracefs: &Path, every_process: bool, kfuncs: bool) -> Result<(Ebpf, bool)> {
    raise_memlock_limit();
    let fork_format = tracefs::Format::read(tracefs, "sched", "sched_process_fork")?;
    let fork_parent = u32::from(fork_format.offset("parent_pid")?);
    let fork_child = u32::from(fork_format.offset("child_pid")?);
    let exit_format = tracefs::Format::read(tracefs, "sched", "sched_process_exit")?;
    let group_dead = u32::from(exit_format.offset("group_dead")?);
    let every_process = u32::from(every_process);
    let filemap = tracefs::Format::read(tracefs, "filemap", "mm_filemap_add_to_page_cache")?;
    let filemap_ino = u32::from(filemap.offset("i_ino")?);
    let filemap_dev = u32::from(filemap.offset("s_dev")?);
    // Kernels before folios (6.x) add one page at a time and have no `order`.
    let filemap_order = filemap.offset("order").map_or(u32::MAX, u32::from);
    // Kernels without FUSE tracepoints get no FUSE tripwire (`Tracer::start`).
    let fuse_connection = tracefs::Format::read(tracefs, "fuse", "fuse_request_send")
        .and_then(|f| f.offset("connection"))
        .map_or(u32::MAX, u32::from);
    // Following only processes that used a watched mount means every watched tree is on
    // FUSE; with the tripwire there, a path syscall reached one only if it made a request.
    let paths_by_request = u32::from(every_process == 0 && fuse_connection != u32::MAX);
    let self_tgid = std::process::id();
    let btf = Btf::from_kernel()?;
    let mut offsets =
        btf::kernel_offsets(&btf).context("finding the kernel struct fields hocus reads")?;
    // A cast needs the kfunc and a struct to cast to; without either, the programs read
    // files with the helper (`file_pointer_type` 0).
    let cast = kfuncs
        .then(|| btf.function(kfunc::RDONLY_CAST_NAME))
        .flatten()
        .filter(|_| offsets.file_pointer_type != 0);
    if cast.is_none() {
        offsets.file_pointer_type = 0;
    }
    let programs = kfuncs::rewrite(
        aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/hocus")),
        kfunc::RDONLY_CAST,
        cast,
    )?;
    let ebpf = EbpfLoader::new()
        .override_global("OFFSETS", &offsets, true)
        .override_global("SELF_TGID", &self_tgid, true)
        .override_global("FORK_PARENT_OFFSET", &fork_parent, true)
        .override_global("FORK_CHILD_OFFSET", &fork_child, true)
        .override_global("EXIT_GROUP_DEAD_OFFSET", &group_dead, true)
        .override_global("TRACE_EVERY_PROCESS", &every_process, true)
        .override_global("FILEMAP_INO_OFFSET", &filemap_ino, true)
        .override_global("FILEMAP_DEV_OFFSET", &filemap_dev, true)
        .override_global("FILEMAP_ORDER_OFFSET", &filemap_order, true)
        .override_global("FUSE_CONNECTION_OFFSET", &fuse_connection, true)
        .override_global("PATHS_BY_REQUEST", &paths_by_request, true)
        .load(kfuncs::as_bytes(&programs))
        .context(
            "loading the eBPF programs into the kernel (needs root, or CAP_BPF and CAP_PERFMON)",
        )?;
    Ok((ebpf, cast.is_some()))
}

/// Loads (through the verifier) and attaches `programs`.
fn attach(
    ebpf: &mut Ebpf,
    programs: &[(&'static str, Attach)],
) -> Result<Vec<(&'static str, Link)>> {
    let mut links = Vec::new();
    let mut kernel_btf = None;
    for &(name, at) in programs {
        let program = ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?;
        match at {
            Attach::Btf(tp) => {
                let btf = match &mut kernel_btf {
                    Some(btf) => btf,
                    None => kernel_btf
                        .insert(aya::Btf::from_sys_fs().context("reading the kernel's BTF")?),
                };
                let p: &mut BtfTracePoint = program.try_into()?;
                p.load(tp, btf)
                    .with_context(|| format!("the kernel's verifier rejected {name}"))?;
                let link = p
                    .attach()
                    .with_context(|| format!("attaching {name} to the tracepoint {tp}"))?;
                links.push((name, Link::Btf(link)));
            }
            Attach::Event(category, tp) => {
                let p: &mut TracePoint = program.try_into()?;
                p.load()
                    .with_context(|| format!("the kernel's verifier rejected {name}"))?;
                let link = p
                    .attach(category, tp)
                    .with_context(|| format!("attaching {name} to {category}:{tp}"))?;
                links.push((name, Link::Event(link)));
            }
        }
    }
    Ok(links)
}

/// The kernel's prefix table: the watched trees, as the agent sees them.
fn prefix_table(trees: &[&Path]) -> Result<Vec<Watched>> {
    if trees.is_empty() || trees.len() > MAX_TREES {
        bail!(
            "between 1 and {MAX_TREES} paths can be watched, not {}",
            trees.len()
        );
    }
    let table = trees
        .iter()
        .map(|path| {
            Watched::new(path.as_os_str().as_encoded_bytes()).with_context(|| {
                format!(
                    "{} is too long to watch (at most {} bytes)",
                    path.display(),
                    MAX_PREFIX - 1
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if table.len() > MAX_WATCHED as usize {
        bail!("too many watched trees (the kernel table holds {MAX_WATCHED})");
    }
    Ok(table)
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; lift it so loading works there.
fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        log::debug!(
            "could not lift RLIMIT_MEMLOCK: {}",
            std::io::Error::last_os_error()
        );
    }
}
