//! Loading the kernel side for this kernel: the programs embedded in this binary, told
//! where the tracepoints' fields are (tracefs), where kernel struct fields are (BTF), and
//! fitted to what the kernel offers (typed tasks, kfuncs, atomics: `probe`, `rewrite`),
//! each choice a `Route` said in the log and in `status`; told which syscalls matter and
//! which trees are watched; then attached where each goes. A kernel variant of a hook is
//! one more entry in `PROGRAMS` (or a choice among entries) here.

use std::path::Path;

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{
        BtfTracePoint, TracePoint, tp_btf::BtfTracePointLinkId, trace_point::TracePointLinkId,
    },
};
use hocus_common::{MAX_PREFIX, MAX_TREES, MAX_WATCHED, SyscallLayout, Watched, kfunc};

use crate::{
    observe::{
        btf::{self, Btf},
        nfs_hooks, probe,
        rewrite::Object,
        syscalls, tracefs,
        tripwires::Tripwire,
    },
    shared::kernel::{self, Route, route},
};

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
pub const SYSCALLS_PROGRAM: &str = "syscall_exit";

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

pub enum Link {
    Btf(BtfTracePointLinkId),
    Event(TracePointLinkId),
    /// At a module's function (`nfs_hooks`).
    Function(nfs_hooks::Link),
}

/// The programs loaded and attached.
pub struct Loaded {
    pub ebpf: Ebpf,
    /// Syscalls this kernel lacks, not traced.
    pub skipped: Vec<String>,
    pub links: Vec<(&'static str, Link)>,
    /// The way each part of the programs takes on this kernel.
    pub routes: Vec<Route>,
    /// Every tripwire's hooks that tell a served job's misses apart are attached: the
    /// tracer may rest while jobs run whose requests all hit local copies.
    pub tells_misses: bool,
    /// The request programs are attached (`REQUEST_PROGRAMS`, or the NFS programs,
    /// `nfs_hooks`): jobs on the watched mounts are learned from their servers' requests
    /// or their client's functions while the syscall program rests.
    pub learns_by_requests: bool,
}

/// What learns from the requests a watched FUSE mount's server gets, where every
/// watched tree is on FUSE and the kernel has the typed tracepoints (newer than Debian
/// 13's 6.12, with FUSE built in: its types are then in vmlinux's BTF).
const REQUEST_PROGRAMS: [(&str, Attach); 2] = [
    ("fuse_sent", Attach::Btf("fuse_request_send")),
    ("fuse_ended", Attach::Btf("fuse_request_end")),
];

/// Loads and attaches the programs for the watched `prefixes`, fitted to this kernel:
/// each feature it lacks has a fallback, said in the routes (and the log); and
/// `tripwires` (which the kernel must have).
pub fn start(prefixes: &[&Path], every_process: bool, tripwires: &[Tripwire]) -> Result<Loaded> {
    let tracefs = tracefs::root()?;
    // The programs loaded and attached, whether they cast files, and what the programs
    // that learn from the filesystems could read.
    let start = |kfuncs| -> Result<(Loaded, Fitted)> {
        let (mut ebpf, mut fitted) = load(&tracefs, every_process, kfuncs)?;
        let skipped = fill_tables(&mut ebpf, &tracefs, prefixes)?;
        let links = attach(&mut ebpf, fitted.kernel_btf.as_ref(), &PROGRAMS).map_err(|e| {
            if fitted.cast {
                e.context(KfuncsRefused)
            } else {
                e
            }
        })?;
        let loaded = Loaded {
            ebpf,
            skipped,
            links,
            routes: std::mem::take(&mut fitted.routes),
            tells_misses: true,
            learns_by_requests: false,
        };
        Ok((loaded, fitted))
    };
    // A kernel whose verifier refuses the kfunc calls still gets the programs.
    let name = kfunc::RDONLY_CAST_NAME;
    let kfuncs = kfuncs_allowed();
    let mut without = if kfuncs {
        format!("this kernel has no {name}: before 6.2")
    } else {
        format!("{}=kfuncs", kernel::FALLBACKS)
    };
    let (mut loaded, fitted) = match start(kfuncs) {
        Err(e) if e.downcast_ref::<KfuncsRefused>().is_some() => {
            log::warn!("{e:#}; loading them without");
            without = format!("the kernel refused {name}");
            start(false)?
        }
        started => started?,
    };
    loaded.routes.push(if fitted.cast {
        route(
            "open files",
            format!("read with plain loads ({name})"),
            false,
        )
    } else {
        route(
            "open files",
            format!("read with a helper call per field ({without})"),
            true,
        )
    });
    for &tripwire in tripwires {
        let hooks: Vec<(&str, Attach)> = tripwire
            .hooks()
            .iter()
            .map(|&(name, (category, event))| (name, Attach::Event(category, event)))
            .collect();
        let links = attach(&mut loaded.ebpf, None, &hooks)?;
        loaded.links.extend(links);
        let (links, all) = attach_miss_hooks(&mut loaded.ebpf, &tracefs, tripwire);
        loaded.links.extend(links);
        loaded.tells_misses &= all;
    }
    let (links, way) = learn_in_filesystems(
        &mut loaded.ebpf,
        every_process,
        tripwires,
        fitted.readable,
        fitted.kernel_btf.as_ref(),
    );
    loaded.learns_by_requests = !links.is_empty();
    loaded.links.extend(links);
    loaded.routes.push(way);
    Ok(loaded)
}

/// What the programs that learn jobs from the filesystems could read on this kernel.
struct Readable {
    /// The FUSE requests (`REQUEST_OFFSETS`).
    requests: bool,
    /// The kernel's BTF, for the NFS programs' attach points, if they could read what
    /// the NFS client's functions are given (`NFS_OFFSETS`).
    nfs: Option<Btf>,
}

const LEARNING: &str = "learning jobs";

fn from_syscalls(why: String, fallback: bool) -> (Vec<(&'static str, Link)>, Route) {
    let way = format!("from their syscalls ({why})");
    (Vec::new(), route(LEARNING, way, fallback))
}

/// Attaches the programs that learn every watched tree's jobs from its filesystem, where
/// every tree is on one filesystem that has them (FUSE or NFS), followed by its
/// tripwire, and the kernel has them. Returns their links (none: not attached), and the
/// route.
fn learn_in_filesystems(
    ebpf: &mut Ebpf,
    every_process: bool,
    tripwires: &[Tripwire],
    readable: Readable,
    kernel_btf: Option<&aya::Btf>,
) -> (Vec<(&'static str, Link)>, Route) {
    if every_process {
        return from_syscalls("not every watched tree is on FUSE or NFS".into(), false);
    }
    match tripwires {
        [Tripwire::Fuse] => learn_by_requests(ebpf, readable.requests, kernel_btf),
        [Tripwire::Nfs] => learn_by_nfs_functions(ebpf, readable.nfs, kernel_btf),
        _ => from_syscalls(
            "some watched trees are on FUSE, others on NFS: each filesystem's programs see only its own".into(),
            false,
        ),
    }
}

/// The FUSE request programs, where the kernel types its requests.
fn learn_by_requests(
    ebpf: &mut Ebpf,
    readable: bool,
    kernel_btf: Option<&aya::Btf>,
) -> (Vec<(&'static str, Link)>, Route) {
    if kernel::forced("fuse-requests") {
        return from_syscalls(kernel::why("fuse-requests", ""), true);
    }
    if !readable {
        let why = "this kernel's BTF has no FUSE requests: FUSE is a module, or the kernel is older than 6.15";
        return from_syscalls(why.into(), true);
    }
    match attach(ebpf, kernel_btf, &REQUEST_PROGRAMS) {
        Ok(links) => {
            let way = "from the requests the FUSE servers get (tp_btf fuse_request_send and fuse_request_end), the syscall program at rest";
            (links, route(LEARNING, way, false))
        }
        Err(e) => {
            log::warn!("{e:#}; jobs are learned from their syscalls");
            from_syscalls(
                format!("the kernel refused the request programs: {e:#}"),
                true,
            )
        }
    }
}

/// The NFS programs, on the NFS client's functions (`nfs_hooks`), where the kernel has
/// BTF for them.
fn learn_by_nfs_functions(
    ebpf: &mut Ebpf,
    vmlinux: Option<Btf>,
    kernel_btf: Option<&aya::Btf>,
) -> (Vec<(&'static str, Link)>, Route) {
    if kernel::forced("nfs-functions") {
        return from_syscalls(kernel::why("nfs-functions", ""), true);
    }
    let Some(vmlinux) = vmlinux else {
        return from_syscalls(
            "this kernel's BTF lacks what the NFS programs read".into(),
            true,
        );
    };
    match nfs_hooks::attach(ebpf, &vmlinux, kernel_btf) {
        Ok(links) => {
            let way = "from the NFS client's functions (fentry and fexit on nfs_file_open, nfs_file_read, nfs_lookup ...), the syscall program at rest";
            let links = links
                .into_iter()
                .map(|(name, link)| (name, Link::Function(link)))
                .collect();
            (links, route(LEARNING, way, false))
        }
        Err(e) => {
            log::info!("{e:#}; jobs on NFS are learned from their syscalls");
            from_syscalls(format!("{e:#}"), true)
        }
    }
}

/// Attaches `tripwire`'s hooks that tell a served job's misses apart, where the kernel
/// has them (and `nfs_change` where `dev` lies where it reads it). Returns the links,
/// and whether every one a rest with jobs needs is attached; one that is missing or
/// refused only keeps jobs followed (said in the log).
fn attach_miss_hooks(
    ebpf: &mut Ebpf,
    tracefs: &Path,
    tripwire: Tripwire,
) -> (Vec<(&'static str, Link)>, bool) {
    let mut links = Vec::new();
    let mut all = true;
    let change_dev = field_offset(tracefs, ("nfs", "nfs_setattr_enter"), "dev");
    for &(name, (category, event), needed) in tripwire.miss_hooks() {
        let present = tracefs.join("events").join(category).join(event).exists();
        let placed =
            name != "nfs_change" || field_offset(tracefs, (category, event), "dev") == change_dev;
        let attached = match (present && placed)
            .then(|| attach(ebpf, None, &[(name, Attach::Event(category, event))]))
        {
            Some(Ok(l)) => {
                links.extend(l);
                true
            }
            Some(Err(e)) => {
                log::warn!("{e:#}");
                false
            }
            None => false,
        };
        if !attached && needed {
            log::info!(
                "no {category}:{event} here: jobs on {} are followed all along",
                tripwire.filesystems()
            );
            all = false;
        }
    }
    (links, all)
}

/// Attaches the floor program (returns at once) where the real ones go, until the
/// returned value is dropped.
pub fn floor() -> Result<Floor> {
    let (mut ebpf, fitted) = load(&tracefs::root()?, false, false)?;
    attach(&mut ebpf, fitted.kernel_btf.as_ref(), &FLOOR)?;
    Ok(Floor { _programs: ebpf })
}

/// Detaches program `name` from where `link` attached it.
pub fn detach(ebpf: &mut Ebpf, name: &str, link: Link) -> Result<()> {
    let program = ebpf
        .program_mut(name)
        .with_context(|| format!("no program {name}"))?;
    match link {
        Link::Btf(id) => <&mut BtfTracePoint>::try_from(program)?.detach(id)?,
        Link::Function(link) => nfs_hooks::detach(program, link)?,
        Link::Event(id) => <&mut TracePoint>::try_from(program)?.detach(id)?,
    }
    Ok(())
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

fn kfuncs_allowed() -> bool {
    !kernel::forced("kfuncs")
}

/// How the programs were fitted to this kernel.
struct Fitted {
    /// The programs cast files (`kfunc::RDONLY_CAST`).
    cast: bool,
    /// What the programs that learn from the filesystems can read.
    readable: Readable,
    routes: Vec<Route>,
    /// aya's reading of the kernel's BTF, made once: the loader's, and the typed
    /// tracepoints' and vmlinux's functions' attach points (each reading takes seconds
    /// under emulation, where every test starts a daemon). None without BTF.
    kernel_btf: Option<aya::Btf>,
}

/// Loads the programs embedded in this binary, with the kernel's struct offsets (from
/// its BTF) and the agent's own process id set, fitted to what this kernel offers;
/// `kfuncs`: calling kfuncs where the kernel has them.
fn load(tracefs: &Path, every_process: bool, kfuncs: bool) -> Result<(Ebpf, Fitted)> {
    raise_memlock_limit();
    let mut routes = Vec::new();
    let fork_format = tracefs::Format::read(tracefs, "sched", "sched_process_fork")?;
    let fork_parent = u32::from(fork_format.offset("parent_pid")?);
    let fork_child = u32::from(fork_format.offset("child_pid")?);
    let exit_format = tracefs::Format::read(tracefs, "sched", "sched_process_exit")?;
    // Older kernels (Debian's 5.10 to 6.12) do not say in the record whether the group
    // is gone: the programs read the group's count instead (`KernelOffsets::signal_live`).
    let group_dead = match exit_format.offset("group_dead") {
        Ok(at) if !kernel::forced("group-dead") => u32::from(at),
        _ => u32::MAX,
    };
    routes.push(if group_dead == u32::MAX {
        let why = kernel::why("group-dead", "sched_process_exit has no group_dead");
        route(
            "processes that exit",
            format!("forgotten by their thread group's count ({why})"),
            true,
        )
    } else {
        route(
            "processes that exit",
            "forgotten by sched_process_exit's group_dead",
            false,
        )
    });
    let every_process = u32::from(every_process);
    let filemap = tracefs::Format::read(tracefs, "filemap", "mm_filemap_add_to_page_cache")?;
    let filemap_ino = u32::from(filemap.offset("i_ino")?);
    let filemap_dev = u32::from(filemap.offset("s_dev")?);
    let filemap_index = u32::from(filemap.offset("index")?);
    // SAFETY: no arguments.
    let page_shift = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        size if size > 0 => (size as u64).trailing_zeros(),
        _ => 12,
    };
    // Kernels before folios (6.x) add one page at a time and have no `order`.
    let filemap_order = filemap.offset("order").map_or(u32::MAX, u32::from);
    routes.push(if filemap_order == u32::MAX {
        route(
            "pages of mapped files",
            "counted a page at a time (mm_filemap_add_to_page_cache has no order)",
            true,
        )
    } else {
        route(
            "pages of mapped files",
            "counted by folio (its order)",
            false,
        )
    });
    // Where the tripwires' records hold the mount's device (`tripwires`), and FUSE's
    // its opcode; nothing is read where the kernel lacks them (not attached then).
    let fuse_connection = field_offset(tracefs, ("fuse", "fuse_request_send"), "connection");
    let fuse_opcode = field_offset(tracefs, ("fuse", "fuse_request_send"), "opcode");
    let nfs = |event, field| field_offset(tracefs, ("nfs", event), field);
    let nfs_lookup_dev = nfs("nfs_lookup_enter", "dev");
    let nfs_lookup_flags = nfs("nfs_lookup_enter", "flags");
    let nfs_create_dev = nfs("nfs_create_enter", "dev");
    let nfs_atomic_open_dev = nfs("nfs_atomic_open_enter", "dev");
    let nfs_change_dev = nfs("nfs_setattr_enter", "dev");
    let nfs4_open_dev = field_offset(tracefs, ("nfs4", "nfs4_open_file"), "dev");
    let nfs_access_dev = field_offset(tracefs, ("nfs", "nfs_access_enter"), "dev");
    // Following only processes that used a watched mount means every watched tree has
    // its tripwire (`trees::follows_every_process`): a path syscall reached one only if
    // its thread tripped it.
    let paths_by_request = u32::from(every_process == 0);
    let self_tgid = std::process::id();
    let btf = Btf::from_kernel()?;
    let mut offsets =
        btf::kernel_offsets(&btf).context("finding the kernel struct fields hocus reads")?;
    // Zeros where the kernel lacks them: the request programs are not attached there.
    let request_offsets = btf::request_offsets(&btf);
    let requests_readable = request_offsets.is_ok();
    let request_offsets = request_offsets.unwrap_or_default();
    let nfs_offsets = btf::nfs_offsets(&btf);
    let nfs_readable = nfs_offsets.is_ok();
    let nfs_offsets = nfs_offsets.unwrap_or_default();
    // 5.10 cannot hand out the current task typed: every field is read with the helper.
    let typed_task = btf.has_helper("get_current_task_btf") && !kernel::forced("typed-task");
    routes.push(if typed_task {
        route(
            "the current task",
            "read with plain loads (bpf_get_current_task_btf)",
            false,
        )
    } else {
        let why = kernel::why("typed-task", "no bpf_get_current_task_btf: before 5.11");
        route(
            "the current task",
            format!("read with a helper call per field ({why})"),
            true,
        )
    });
    // A cast needs the kfunc and a struct to cast to; without either, the programs read
    // files with the helper (`file_pointer_type` 0).
    let cast = kfuncs
        .then(|| btf.function(kfunc::RDONLY_CAST_NAME))
        .flatten()
        .filter(|_| offsets.file_pointer_type != 0 && typed_task);
    if cast.is_none() {
        offsets.file_pointer_type = 0;
    }
    let mut programs = Object::new(aya::include_bytes_aligned!(concat!(
        env!("OUT_DIR"),
        "/hocus"
    )));
    programs.kfunc_calls(kfunc::RDONLY_CAST, cast)?;
    // Before 5.12 the verifier refuses any compare-exchange in the object.
    routes.push(if probe::atomics() && !kernel::forced("atomics") {
        route(
            "closes of watched files",
            "claimed by a compare-exchange",
            false,
        )
    } else {
        programs.plain_compare_exchanges()?;
        let why = kernel::why("atomics", "no BPF atomics: before 5.12");
        route(
            "closes of watched files",
            format!(
                "claimed by a plain store ({why}); a close racing another thread's open of \
                 the same number may be sent twice, and is counted once"
            ),
            true,
        )
    });
    let typed_task = u32::from(typed_task);
    let kernel_btf = aya::Btf::from_sys_fs().ok();
    let ebpf = EbpfLoader::with_btf(kernel_btf.as_ref())
        .override_global("OFFSETS", &offsets, true)
        .override_global("TYPED_TASK", &typed_task, true)
        .override_global("REQUEST_OFFSETS", &request_offsets, true)
        .override_global("NFS_OFFSETS", &nfs_offsets, true)
        .override_global("SELF_TGID", &self_tgid, true)
        .override_global("FORK_PARENT_OFFSET", &fork_parent, true)
        .override_global("FORK_CHILD_OFFSET", &fork_child, true)
        .override_global("EXIT_GROUP_DEAD_OFFSET", &group_dead, true)
        .override_global("TRACE_EVERY_PROCESS", &every_process, true)
        .override_global("FILEMAP_INO_OFFSET", &filemap_ino, true)
        .override_global("FILEMAP_DEV_OFFSET", &filemap_dev, true)
        .override_global("FILEMAP_ORDER_OFFSET", &filemap_order, true)
        .override_global("FILEMAP_INDEX_OFFSET", &filemap_index, true)
        .override_global("PAGE_SHIFT", &page_shift, true)
        .override_global("FUSE_CONNECTION_OFFSET", &fuse_connection, true)
        .override_global("FUSE_OPCODE_OFFSET", &fuse_opcode, true)
        .override_global("NFS_LOOKUP_DEV_OFFSET", &nfs_lookup_dev, true)
        .override_global("NFS_LOOKUP_FLAGS_OFFSET", &nfs_lookup_flags, true)
        .override_global("NFS_CREATE_DEV_OFFSET", &nfs_create_dev, true)
        .override_global("NFS_ATOMIC_OPEN_DEV_OFFSET", &nfs_atomic_open_dev, true)
        .override_global("NFS4_OPEN_DEV_OFFSET", &nfs4_open_dev, true)
        .override_global("NFS_CHANGE_DEV_OFFSET", &nfs_change_dev, true)
        .override_global("NFS_ACCESS_DEV_OFFSET", &nfs_access_dev, true)
        .override_global("PATHS_BY_REQUEST", &paths_by_request, true)
        .load(programs.bytes())
        .context(
            "loading the eBPF programs into the kernel (needs root, or CAP_BPF and CAP_PERFMON)",
        )?;
    let fitted = Fitted {
        cast: cast.is_some(),
        readable: Readable {
            requests: requests_readable,
            nfs: nfs_readable.then_some(btf),
        },
        routes,
        kernel_btf,
    };
    Ok((ebpf, fitted))
}

/// The offset of `field` in `event`'s records, or u32::MAX (a read that fails) where the
/// kernel has no such event.
fn field_offset(tracefs: &Path, (category, event): (&str, &str), field: &str) -> u32 {
    tracefs::Format::read(tracefs, category, event)
        .and_then(|f| f.offset(field))
        .map_or(u32::MAX, u32::from)
}

/// Loads (through the verifier) and attaches `programs`; `kernel_btf` (aya's reading)
/// is needed for typed tracepoints.
fn attach(
    ebpf: &mut Ebpf,
    kernel_btf: Option<&aya::Btf>,
    programs: &[(&'static str, Attach)],
) -> Result<Vec<(&'static str, Link)>> {
    let mut links = Vec::new();
    for &(name, at) in programs {
        let program = ebpf
            .program_mut(name)
            .with_context(|| format!("no program {name}"))?;
        match at {
            Attach::Btf(tp) => {
                let btf = kernel_btf.with_context(|| {
                    format!("{name} needs the kernel's BTF (/sys/kernel/btf/vmlinux), which aya could not read")
                })?;
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
                // One program may go on several tracepoints (`nfs_change`).
                if p.fd().is_err() {
                    p.load()
                        .with_context(|| format!("the kernel's verifier rejected {name}"))?;
                }
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
