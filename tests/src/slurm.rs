//! A real one-node Slurm cluster for the tests: its own munged (with a key made here),
//! slurmctld and slurmd, from Debian's packages, on ports of its own, started once per
//! test binary and gone with it. Jobs are submitted as the ordinary test user with
//! `srun` and `sbatch`.

use std::{
    fs,
    os::unix::{
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{OnceLock, mpsc},
    thread,
    time::{Duration, Instant},
};

use crate::{free_port, require_root, test_user};

/// Where the cluster lives: under /run, root-owned (munged refuses a world-writable
/// parent such as /tmp).
const HOME: &str = "/run/hocus-test-slurm";
/// The test user's name (see `test_user`).
const USER: &str = "hocus-test";

pub struct Slurm {
    pub dir: PathBuf,
    pub conf: PathBuf,
    /// The cluster's munged, for every node.
    pub munge_socket: PathBuf,
    plugstack: PathBuf,
    /// A many-node cluster's nodes (`Options::nodes`); empty for the one-node cluster.
    pub nodes: Vec<Node>,
    /// A many-node cluster's login namespace (bridge, slurmctld, the clients) and file
    /// server's, as processes holding them.
    login: Option<u32>,
    pub server: Option<u32>,
    /// munged, slurmctld, slurmd: killed with this test binary (see `slurm`).
    _daemons: Vec<Child>,
}

/// How the cluster is configured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// `JobContainerType=job_container/tmpfs`: each job in a mount namespace of its own
    /// with a private /tmp and /dev/shm (what many sites run).
    pub job_container_tmpfs: bool,
    /// 0: one node, this machine on loopback. N: N nodes, each a network namespace and a
    /// mount namespace of its own (its own slurmd, `node1` ... at 10.77.0.11 ...), on a
    /// bridge in a login namespace (slurmctld and the clients, 10.77.0.254), with a file
    /// server's namespace beside them (10.77.0.1). No address is the machine's: nothing
    /// leaves these namespaces, and they go with the test binary.
    pub nodes: usize,
}

/// A node of a many-node cluster.
#[derive(Debug, Clone)]
pub struct Node {
    pub name: String,
    pub addr: String,
    /// The process holding its network and mount namespaces (`nsenter -t` it).
    pub holder: u32,
}

/// The file server's address in a many-node cluster.
pub const SERVER_ADDR: &str = "10.77.0.1";
const LOGIN_ADDR: &str = "10.77.0.254";

static CLUSTER: OnceLock<(Options, Slurm)> = OnceLock::new();

/// The cluster of this test binary, started on first use.
pub fn slurm() -> &'static Slurm {
    slurm_with(Options::default())
}

/// The cluster of this test binary, configured so (one configuration per binary).
pub fn slurm_with(options: Options) -> &'static Slurm {
    let (had, cluster) = CLUSTER.get_or_init(|| {
        // The daemons are children of a thread that never ends: they get SIGKILL when it
        // does, i.e. when this test binary exits, whatever way it exits.
        let (tx, rx) = mpsc::channel();
        thread::Builder::new()
            .name("slurm-cluster".into())
            .spawn(move || {
                tx.send(Slurm::start(options)).unwrap();
                loop {
                    thread::park();
                }
            })
            .unwrap();
        match rx.recv() {
            Ok(s) => (options, s),
            Err(_) => panic!("the Slurm cluster did not start (see the panic above)"),
        }
    });
    assert_eq!(*had, options, "one cluster configuration per test binary");
    cluster
}

fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: prctl in the child before exec; async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// A process holding new namespaces (`unshare` flags) until the test binary exits.
fn holder(flags: &[&str], daemons: &mut Vec<Child>) -> u32 {
    let mut cmd = Command::new("unshare");
    cmd.args(flags).args(["sleep", "infinity"]);
    let child = die_with_parent(&mut cmd).spawn().expect("unshare");
    let pid = child.id();
    daemons.push(child);
    // Until unshare has made them, the pid's namespaces are ours.
    let ours = fs::read_link("/proc/self/ns/net").unwrap();
    wait_for(10, "the namespaces", || {
        fs::read_link(format!("/proc/{pid}/ns/net")).is_ok_and(|n| n != ours)
    });
    pid
}

fn ip_in(holder: u32, args: &str) {
    let ok = Command::new("nsenter")
        .args(["-t", &holder.to_string(), "-n", "ip"])
        .args(args.split(' '))
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "ip {args} in the namespace of {holder}");
}

/// The namespaces of a many-node cluster: a bridge in the login namespace, and each
/// other namespace on it through a veth pair.
fn network(n: usize, daemons: &mut Vec<Child>) -> (u32, u32, Vec<Node>) {
    let login = holder(&["-n"], daemons);
    ip_in(login, "link add br0 type bridge");
    ip_in(login, &format!("addr add {LOGIN_ADDR}/24 dev br0"));
    ip_in(login, "link set br0 up");
    ip_in(login, "link set lo up");
    let join = |pid: u32, k: usize, addr: &str| {
        ip_in(
            login,
            &format!("link add v{k} type veth peer name eth0 netns {pid}"),
        );
        ip_in(login, &format!("link set v{k} master br0 up"));
        ip_in(pid, &format!("addr add {addr}/24 dev eth0"));
        ip_in(pid, "link set eth0 up");
        ip_in(pid, "link set lo up");
    };
    let server = holder(&["-n"], daemons);
    join(server, 0, SERVER_ADDR);
    let nodes = (1..=n)
        .map(|k| {
            let pid = holder(&["-n", "-m", "--propagation", "slave"], daemons);
            let addr = format!("10.77.0.{}", 10 + k);
            join(pid, k, &addr);
            Node {
                name: format!("node{k}"),
                addr,
                holder: pid,
            }
        })
        .collect();
    (login, server, nodes)
}

/// `cmd` run in the network (and mount, `mount`) namespace of `holder`.
fn inside(holder: u32, mount: bool, cmd: Command) -> Command {
    let mut c = Command::new("nsenter");
    c.args(["-t", &holder.to_string(), "-n"]);
    if mount {
        c.arg("-m");
    }
    c.arg("--").arg(cmd.get_program()).args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    if let Some(d) = cmd.get_current_dir() {
        c.current_dir(d);
    }
    c
}

fn hostname() -> String {
    let out = Command::new("hostname")
        .arg("-s")
        .output()
        .expect("hostname");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl Slurm {
    fn start(options: Options) -> Slurm {
        require_root();
        test_user();
        for tool in ["munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo"] {
            let found = Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .env(
                    "PATH",
                    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                )
                .output()
                .is_ok_and(|o| o.status.success());
            assert!(
                found,
                "{tool} is missing: cargo xtask setup installs slurmd, slurmctld, slurm-client and munge"
            );
        }
        let dir = PathBuf::from(HOME).join(std::process::id().to_string());
        let _ = fs::remove_dir_all(&dir);
        for sub in ["state", "spool", "log", "munge"] {
            fs::create_dir_all(dir.join(sub)).unwrap();
        }
        for d in [Path::new(HOME), &dir, &dir.join("log")] {
            fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
        }
        // munged: a key of its own, its socket reachable by everyone (srun as the user).
        let munge = dir.join("munge");
        fs::write(munge.join("munge.key"), random_key()).unwrap();
        fs::set_permissions(munge.join("munge.key"), fs::Permissions::from_mode(0o400)).unwrap();
        fs::set_permissions(&munge, fs::Permissions::from_mode(0o755)).unwrap();
        let chown = Command::new("chown")
            .args(["-R", "munge:munge"])
            .arg(&munge)
            .status()
            .unwrap();
        assert!(chown.success());
        let socket = munge.join("munge.socket.2");
        // Started as the munge user directly, not through runuser: runuser's child would
        // outlive the test binary (the parent-death signal is runuser's alone).
        let owner = fs::metadata(&munge).unwrap();
        let mut munged = Command::new("munged");
        munged
            .uid(owner.uid())
            .gid(owner.gid())
            .args(["--foreground", "--force"])
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", munge.join("munge.key").display()))
            .arg(format!("--pid-file={}", munge.join("munged.pid").display()))
            .arg(format!("--log-file={}", munge.join("munged.log").display()))
            .arg(format!(
                "--seed-file={}",
                munge.join("munged.seed").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut daemons = vec![die_with_parent(&mut munged).spawn().expect("munged")];
        wait_for(10, "munged's socket", || socket.exists());

        let host = hostname();
        let (ctld_port, slurmd_port) = (free_port(), free_port());
        let (login, server, nodes) = match options.nodes {
            0 => (None, None, Vec::new()),
            n => {
                let (login, server, nodes) = network(n, &mut daemons);
                (Some(login), Some(server), nodes)
            }
        };
        let (ctld_addr, node_lines, partition, each) = if nodes.is_empty() {
            (
                "127.0.0.1".to_owned(),
                format!(
                    "NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN\n"
                ),
                host.clone(),
                "",
            )
        } else {
            let lines: String = nodes
                .iter()
                .map(|n| {
                    format!(
                        "NodeName={} NodeAddr={} CPUs=2 RealMemory=1000 State=UNKNOWN\n",
                        n.name, n.addr
                    )
                })
                .collect();
            (
                LOGIN_ADDR.to_owned(),
                lines,
                format!("node[1-{}]", nodes.len()),
                "-%n",
            )
        };
        // slurmd runs the plugins' job prolog and epilog only if it found a plugin with
        // them when it started: it starts with hocus's (off until a test says more).
        let plugstack = dir.join("plugstack.conf");
        fs::write(
            &plugstack,
            format!("optional {} off\n", plugin_path().display()),
        )
        .unwrap();
        let conf = dir.join("slurm.conf");
        let d = dir.display();
        // `config_overrides`: a node is the 2 CPUs it is configured with even where the
        // machine has fewer (the rig's guests have one), rather than invalid.
        fs::write(
            &conf,
            format!(
                "ClusterName=hocus-test\n\
                 SlurmctldHost={host}({ctld_addr})\n\
                 SlurmUser=root\nSlurmdUser=root\n\
                 SlurmctldPort={ctld_port}\nSlurmdPort={slurmd_port}\n\
                 AuthType=auth/munge\nCredType=cred/munge\n\
                 AuthInfo=socket={socket}\n\
                 StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool{each}\n\
                 SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd{each}.pid\n\
                 SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd{each}.log\n\
                 SlurmdDebug=verbose\n\
                 ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
                 JobAcctGatherType=jobacct_gather/none\n\
                 AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\n\
                 SchedulerType=sched/builtin\n\
                 SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 MpiDefault=none\nSwitchType=switch/none\nReturnToService=2\n\
                 SlurmdParameters=config_overrides\n\
                 PlugStackConfig={plugstack}\n\
                 {node_lines}\
                 PartitionName=debug Nodes={partition} Default=YES MaxTime=INFINITE State=UP\n",
                socket = socket.display(),
                plugstack = plugstack.display(),
            ),
        )
        .unwrap();
        if options.job_container_tmpfs {
            // Read from beside slurm.conf.
            fs::write(
                dir.join("job_container.conf"),
                format!("AutoBasePath=true\nBasePath={}/containers\n", dir.display()),
            )
            .unwrap();
            let mut f = fs::OpenOptions::new().append(true).open(&conf).unwrap();
            std::io::Write::write_all(
                &mut f,
                b"JobContainerType=job_container/tmpfs\nPrologFlags=Contain\n",
            )
            .unwrap();
        }
        // Read from beside slurm.conf. Under cgroup v2, slurmd asks systemd over D-Bus for
        // its stepd's scope unless told not to: a machine without systemd (the rig's
        // guests) makes it there itself.
        fs::write(dir.join("cgroup.conf"), "IgnoreSystemd=yes\n").unwrap();
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        if v2 && !Path::new("/sys/fs/cgroup/system.slice").exists() {
            fs::create_dir("/sys/fs/cgroup/system.slice").unwrap();
        }
        fs::set_permissions(&conf, fs::Permissions::from_mode(0o644)).unwrap();
        let mut start = |cmd: Command, at: Option<(u32, bool)>| {
            let mut cmd = match at {
                Some((holder, mount)) => inside(holder, mount, cmd),
                None => cmd,
            };
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
            let what = format!("{cmd:?}");
            daemons.push(
                die_with_parent(&mut cmd)
                    .spawn()
                    .unwrap_or_else(|e| panic!("{what}: {e}")),
            );
        };
        let daemon = |name: &str, node: Option<&str>| {
            let mut cmd = Command::new(name);
            cmd.args(["-D", "-f"]).arg(&conf);
            if let Some(node) = node {
                cmd.args(["-N", node]);
            }
            cmd
        };
        start(daemon("slurmctld", None), login.map(|l| (l, false)));
        if nodes.is_empty() {
            start(daemon("slurmd", None), None);
        }
        if !nodes.is_empty() {
            // Nodes find each other by name, as on a cluster: /etc/hosts of their own.
            let hosts = dir.join("hosts");
            let names: String = nodes
                .iter()
                .map(|n| format!("{} {}\n", n.addr, n.name))
                .collect();
            fs::write(&hosts, format!("127.0.0.1 localhost\n{names}")).unwrap();
            fs::set_permissions(&hosts, fs::Permissions::from_mode(0o644)).unwrap();
            for n in &nodes {
                let bound = Command::new("nsenter")
                    .args(["-t", &n.holder.to_string(), "-m", "--", "mount", "--bind"])
                    .arg(&hosts)
                    .arg("/etc/hosts")
                    .status()
                    .unwrap();
                assert!(bound.success(), "/etc/hosts for {}", n.name);
            }
        }
        for n in &nodes {
            start(daemon("slurmd", Some(&n.name)), Some((n.holder, true)));
        }
        let slurm = Slurm {
            dir,
            conf,
            munge_socket: socket,
            plugstack,
            nodes,
            login,
            server,
            _daemons: daemons,
        };
        wait_for(60, "the Slurm node to be idle", || {
            slurm
                .command("sinfo")
                .args(["-h", "-o", "%T"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
        });
        slurm
    }

    /// A hocus daemon on `node` with `args` (the cluster's munged added), in its network
    /// and mount namespaces, its control socket at /run/hocus/agent.sock on that node
    /// (the plugin's default) in place of any earlier one's.
    pub fn agent_on(&self, node: &Node, args: &[&str]) -> crate::Agent {
        let munge = self.munge_socket.to_str().unwrap();
        let mut all = args.to_vec();
        all.extend_from_slice(&["--munge-socket", munge]);
        let agent = crate::Agent::start_in_namespace_of(node.holder, &all);
        fs::create_dir_all("/run/hocus").unwrap();
        // Over an earlier daemon's (its directory gone): that one is taken away first.
        let bound = Command::new("nsenter")
            .args(["-t", &node.holder.to_string(), "-m", "--", "sh", "-c"])
            .arg(format!(
                "while umount -l /run/hocus 2>/dev/null; do :; done; mount --bind {} /run/hocus",
                agent.dir.path().display()
            ))
            .status()
            .unwrap();
        assert!(
            bound.success(),
            "binding {}'s daemon at /run/hocus",
            node.name
        );
        agent
    }

    /// A Slurm client command (as root) against this cluster (in its login namespace).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("SLURM_CONF", &self.conf).current_dir("/");
        self.at_login(cmd)
    }

    /// `cmd` in the login namespace (not one of the nodes).
    pub fn at_login(&self, cmd: Command) -> Command {
        match self.login {
            Some(login) => inside(login, false, cmd),
            None => cmd,
        }
    }

    /// A Slurm client command run by the ordinary test user, from `/tmp`, with `env`
    /// added to its environment (which Slurm passes on to the job).
    pub fn as_user(&self, program: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
        self.command_as_user(program, args, env)
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"))
    }

    /// The same command, to start in the background.
    pub fn command_as_user(&self, program: &str, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", USER, "--", "env"])
            .arg(format!("SLURM_CONF={}", self.conf.display()));
        for (k, v) in env {
            cmd.arg(format!("{k}={v}"));
        }
        cmd.arg(program).args(args).current_dir("/tmp");
        let mut cmd = self.at_login(cmd);
        cmd.stdin(Stdio::null());
        cmd
    }

    /// Loads hocus's plugin with this plugstack line's arguments (none: no plugin).
    /// Each job step's slurmstepd reads the file as it starts.
    pub fn plugin(&self, args: Option<&str>) {
        let line = args.map_or(String::new(), |a| {
            format!("optional {} {a}\n", plugin_path().display())
        });
        fs::write(&self.plugstack, line).unwrap();
    }

    /// What slurmd and the job steps logged (every node's).
    pub fn slurmd_log(&self) -> String {
        let mut logs: Vec<PathBuf> = fs::read_dir(self.dir.join("log"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        logs.sort();
        logs.iter()
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("slurmd"))
            })
            .map(|p| fs::read_to_string(p).unwrap_or_default())
            .collect()
    }
}

/// The plugin built beside the agent (`cargo xtask test` builds both).
pub fn plugin_path() -> PathBuf {
    if let Some(p) = std::env::var_os("HOCUS_SPANK_PLUGIN") {
        return PathBuf::from(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/libhocus_spank.so");
    assert!(
        p.exists(),
        "no SPANK plugin at {}: run the tests with cargo xtask test",
        p.display()
    );
    p
}

fn wait_for(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "waited {secs} s for {what}");
        thread::sleep(Duration::from_millis(200));
    }
}

fn random_key() -> Vec<u8> {
    let mut key = vec![0u8; 1024];
    // SAFETY: fills a buffer of the length given.
    let n = unsafe { libc::getrandom(key.as_mut_ptr().cast(), key.len(), 0) };
    assert_eq!(n, 1024, "getrandom");
    key
}
