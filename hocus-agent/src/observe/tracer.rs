//! The kernel side, from the agent: loads the eBPF programs embedded in this binary,
//! tells them where syscall arguments are (from tracefs) and which paths are watched,
//! attaches them, and reads what they report.

use std::{
    os::fd::{AsRawFd, RawFd},
    path::Path,
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{TracePoint, trace_point::TracePointLinkId},
};
use hocus_common::{
    Event, FdKey, MAX_PREFIX, MAX_TREES, MAX_WATCHED, OpenFile, SyscallLayout, Watched, counter,
};

use crate::observe::{
    syscalls::{self, Programs},
    tracefs,
};

pub struct Tracer {
    // Owns the programs and their tracepoint links: dropping it detaches everything.
    ebpf: Ebpf,
    /// Each program's tracepoint links, to detach them all at once.
    links: Vec<(&'static str, TracePointLinkId)>,
    events: RingBuf<MapData>,
    open_files: HashMap<MapData, FdKey, OpenFile>,
    cwd: HashMap<MapData, u32, u8>,
    counters: PerCpuArray<MapData, u64>,
    /// Syscalls this kernel lacks, skipped.
    pub skipped: Vec<String>,
}

/// The programs, and the syscalls each is attached to (None: its sched tracepoint).
const PROGRAMS: [(&str, Option<Programs>); 6] = [
    ("path_enter", Some(Programs::Path)),
    ("path_exit", Some(Programs::Path)),
    ("fd_enter", Some(Programs::Fd)),
    ("fd_exit", Some(Programs::FdWithExit)),
    ("process_fork", None),
    ("process_exit", None),
];

/// Kernel-side counters, summed over CPUs, by `hocus_common::counter` index.
pub type Counters = [u64; counter::COUNT as usize];

impl Tracer {
    /// Loads and attaches the programs for the given watched prefixes (canonical paths).
    pub fn start(prefixes: &[&Path]) -> Result<Self> {
        raise_memlock_limit();
        let tracefs = tracefs::root()?;
        let exit_format = tracefs::Format::read(&tracefs, "syscalls", "sys_exit_openat")?;
        let nr_offset = u32::from(exit_format.offset("__syscall_nr")?);
        let ret_offset = u32::from(exit_format.offset("ret")?);
        let fork_format = tracefs::Format::read(&tracefs, "sched", "sched_process_fork")?;
        let fork_parent = u32::from(fork_format.offset("parent_pid")?);
        let fork_child = u32::from(fork_format.offset("child_pid")?);
        let self_tgid = std::process::id();

        let mut ebpf = EbpfLoader::new()
            .override_global("SELF_TGID", &self_tgid, true)
            .override_global("NR_OFFSET", &nr_offset, true)
            .override_global("RET_OFFSET", &ret_offset, true)
            .override_global("FORK_PARENT_OFFSET", &fork_parent, true)
            .override_global("FORK_CHILD_OFFSET", &fork_child, true)
            .load(aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/hocus")))
            .context("loading the eBPF programs into the kernel (needs root, or CAP_BPF and CAP_PERFMON)")?;

        // Where each syscall's arguments are, by syscall number.
        let mut table: Array<_, SyscallLayout> =
            Array::try_from(ebpf.map_mut("SYSCALLS").context("no SYSCALLS map")?)?;
        let mut traced = Vec::new();
        let mut skipped = Vec::new();
        for t in syscalls::all() {
            match t.layout(&tracefs) {
                Ok(layout) => {
                    table.set(t.nr as u32, layout, 0)?;
                    traced.push(t);
                }
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

        let mut links = Vec::new();
        for (program, wants) in PROGRAMS {
            let tp: &mut TracePoint = ebpf
                .program_mut(program)
                .with_context(|| format!("no program {program}"))?
                .try_into()?;
            tp.load()
                .with_context(|| format!("the kernel's verifier rejected {program}"))?;
            let Some(wants) = wants else {
                let name = format!("sched_{program}");
                let link = tp
                    .attach("sched", &name)
                    .with_context(|| format!("attaching {program} to sched:{name}"))?;
                links.push((program, link));
                continue;
            };
            for t in &traced {
                let is_enter = program.ends_with("_enter");
                let attach = match wants {
                    Programs::Fd => matches!(t.programs, Programs::Fd | Programs::FdWithExit),
                    other => t.programs == other,
                };
                if !attach {
                    continue;
                }
                let tracepoint =
                    format!("sys_{}_{}", if is_enter { "enter" } else { "exit" }, t.name);
                let link = tp
                    .attach("syscalls", &tracepoint)
                    .with_context(|| format!("attaching {program} to syscalls:{tracepoint}"))?;
                links.push((program, link));
            }
        }

        let events = RingBuf::try_from(ebpf.take_map("EVENTS").context("no EVENTS map")?)?;
        let open_files =
            HashMap::try_from(ebpf.take_map("OPEN_FILES").context("no OPEN_FILES map")?)?;
        let cwd = HashMap::try_from(ebpf.take_map("CWD").context("no CWD map")?)?;
        let counters =
            PerCpuArray::try_from(ebpf.take_map("COUNTERS").context("no COUNTERS map")?)?;
        Ok(Self {
            ebpf,
            links,
            events,
            open_files,
            cwd,
            counters,
            skipped,
        })
    }

    /// Detaches and unloads the programs: nothing more is traced. The maps stay readable.
    pub fn detach(&mut self) {
        let t0 = std::time::Instant::now();
        let mut taken = Vec::new();
        for (name, id) in self.links.drain(..) {
            let program: Option<&mut TracePoint> =
                self.ebpf.program_mut(name).and_then(|p| p.try_into().ok());
            if let Some(link) = program.and_then(|tp| tp.take_link(id).ok()) {
                taken.push(link);
            }
        }
        // The kernel waits for a grace period as each tracepoint loses its last user: one
        // link after another, ~70 links took 5 s here; in parallel 2.5 s.
        std::thread::scope(|s| {
            for link in taken {
                s.spawn(move || drop(link));
            }
        });
        log::debug!("tracepoint links detached in {:?}", t0.elapsed());
        for (name, _) in PROGRAMS {
            let Some(program) = self.ebpf.program_mut(name) else {
                continue;
            };
            let tracepoint: Result<&mut TracePoint, _> = program.try_into();
            if let Err(e) = tracepoint.map(|tp| tp.unload()) {
                log::warn!("could not unload {name}: {e}");
            }
        }
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

    /// Tells the kernel where a process's working directory is (`hocus_common::cwd`).
    pub fn set_cwd(&mut self, tgid: u32, place: u8) {
        let _ = self.cwd.insert(tgid, place, 0);
    }

    /// The watched files processes have open now, with what they have read so far.
    pub fn open_files(&self) -> Vec<(FdKey, OpenFile)> {
        self.open_files.iter().filter_map(Result::ok).collect()
    }

    pub fn forget_open_file(&mut self, key: &FdKey) {
        let _ = self.open_files.remove(key);
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

/// The kernel's prefix table: the watched trees, then each directory above one (so the
/// kernel knows a process there can reach a tree by a relative path).
fn prefix_table(trees: &[&Path]) -> Result<Vec<Watched>> {
    if trees.is_empty() || trees.len() > MAX_TREES {
        bail!(
            "between 1 and {MAX_TREES} paths can be watched, not {}",
            trees.len()
        );
    }
    let entry = |path: &Path, kind| {
        Watched::new(path.as_os_str().as_encoded_bytes(), kind).with_context(|| {
            format!(
                "{} is too long to watch (at most {} bytes)",
                path.display(),
                MAX_PREFIX - 1
            )
        })
    };
    let mut table = trees
        .iter()
        .map(|t| entry(t, Watched::TREE))
        .collect::<Result<Vec<_>>>()?;
    let mut above: Vec<&Path> = trees.iter().flat_map(|t| t.ancestors().skip(1)).collect();
    above.sort();
    above.dedup();
    for dir in above {
        table.push(entry(dir, Watched::ABOVE)?);
    }
    if table.len() > MAX_WATCHED as usize {
        bail!(
            "the watched trees are too deep or too many (the kernel table holds {MAX_WATCHED} entries with their parents)"
        );
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
