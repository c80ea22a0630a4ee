//! `cargo xtask package`: the Debian package an admin installs on every node: the
//! daemon, its systemd unit (installed, not enabled), /etc/hocus/agent.toml, the Slurm
//! SPANK plugin and its plugstack snippet, man pages and shell completions generated
//! from the command line itself, and the docs. Built with Debian's own `dpkg-deb` from
//! the release build. Removing the package leaves the cache and the profiles; purging
//! removes them.
//!
//! `cargo xtask test` installs the package it builds, runs the Slurm tests against the
//! installed files, then removes and purges it, checking each step.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::host::{status, target_dir, workspace};

pub const NAME: &str = "hocus";
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Where the package puts the daemon and the plugin.
pub const AGENT: &str = "/usr/bin/hocus-agent";
pub const PLUGIN: &str = "/usr/lib/hocus/hocus_spank.so";
const STATE: [&str; 2] = ["/var/lib/hocus", "/var/cache/hocus"];

const CONTROL: &str = "Package: hocus
Version: {version}
Architecture: amd64
Maintainer: hocus developers <hocus@localhost>
Section: admin
Priority: optional
Depends: libc6 (>= 2.36)
Recommends: fuse3
Suggests: slurmd, prometheus
Installed-Size: {size}
Description: keeps the working sets of jobs on network filesystems local
 hocus-agent is a root daemon: eBPF tracepoints observe what jobs open, look up
 in vain and read on watched network mounts (NFS, Lustre, GPFS, sshfs ...); it
 copies the hot files to a local SSD cache, pins the hottest in RAM, and binds
 them read-only over the network paths in jobs' mount namespaces. Slurm jobs get
 them through a SPANK plugin, with nothing changed in how they are submitted.
 .
 The daemon is installed disabled: set watch = [...] in /etc/hocus/agent.toml,
 then systemctl enable --now hocus-agent. The SPANK plugin (built for Slurm
 {slurm}) is listed in /etc/slurm/plugstack.conf.d/hocus.conf.
";

const POSTINST: &str = "#!/bin/sh
set -e
if [ \"$1\" = configure ]; then
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
    fi
    echo 'hocus: hocus-agent is installed but not enabled. Set watch = [...] in /etc/hocus/agent.toml, then: systemctl enable --now hocus-agent' >&2
    echo 'hocus: restart slurmd once so that job prologs and epilogs keep and prefetch job profiles' >&2
fi
";

const PRERM: &str = "#!/bin/sh
set -e
if [ \"$1\" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop hocus-agent.service || true
fi
";

const POSTRM: &str = "#!/bin/sh
set -e
if [ \"$1\" = purge ]; then
    rm -rf /var/lib/hocus /var/cache/hocus
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
";

/// Builds the package from the release build (`agent`, with the plugin beside it);
/// returns its path.
pub fn build(agent: &Path) -> Result<PathBuf> {
    let root = workspace();
    let out = target_dir().join("package");
    let stage = out.join(format!("{NAME}_{VERSION}_amd64"));
    let _ = fs::remove_dir_all(&stage);
    let put = |from: &Path, to: &str, mode: u32| -> Result<()> {
        let dest = stage.join(to.trim_start_matches('/'));
        fs::create_dir_all(dest.parent().unwrap())?;
        fs::copy(from, &dest).with_context(|| format!("copying {}", from.display()))?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    put(agent, AGENT, 0o755)?;
    put(&agent.with_file_name("libhocus_spank.so"), PLUGIN, 0o644)?;
    put(
        &root.join("contrib/hocus-agent.service"),
        "/lib/systemd/system/hocus-agent.service",
        0o644,
    )?;
    put(
        &root.join("contrib/agent.toml"),
        "/etc/hocus/agent.toml",
        0o644,
    )?;
    let snippet = fs::read_to_string(root.join("contrib/slurm/plugstack.conf.d/hocus.conf"))?;
    if !snippet.contains(PLUGIN) {
        bail!("contrib/slurm/plugstack.conf.d/hocus.conf does not name {PLUGIN}");
    }
    put(
        &root.join("contrib/slurm/plugstack.conf.d/hocus.conf"),
        "/etc/slurm/plugstack.conf.d/hocus.conf",
        0o644,
    )?;
    let doc = "/usr/share/doc/hocus";
    put(&root.join("README.md"), &format!("{doc}/README.md"), 0o644)?;
    for entry in fs::read_dir(root.join("docs"))? {
        let path = entry?.path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        put(&path, &format!("{doc}/docs/{name}"), 0o644)?;
    }
    fs::write(
        stage.join("usr/share/doc/hocus/copyright"),
        "hocus\nLicense: MIT OR Apache-2.0\n",
    )?;

    // Man pages and completions, from the binary's own command line.
    let man = stage.join("usr/share/man/man1");
    status(Command::new(agent).args(["generate", "man"]).arg(&man))?;
    for page in fs::read_dir(&man)? {
        let page = page?.path();
        // Hidden commands are not the user's.
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        if name.contains("trace-floor") || name.contains("generate") {
            fs::remove_file(&page)?;
            continue;
        }
        status(Command::new("gzip").args(["-9n"]).arg(&page))?;
    }
    for (shell, dir) in [
        ("bash", "usr/share/bash-completion/completions"),
        ("zsh", "usr/share/zsh/vendor-completions"),
        ("fish", "usr/share/fish/vendor_completions.d"),
    ] {
        status(
            Command::new(agent)
                .args(["generate", "completions", shell])
                .arg(stage.join(dir)),
        )?;
    }
    let bash = stage.join("usr/share/bash-completion/completions");
    if bash.join("hocus-agent.bash").exists() {
        fs::rename(bash.join("hocus-agent.bash"), bash.join("hocus-agent"))?;
    }

    // Control files.
    let debian = stage.join("DEBIAN");
    fs::create_dir_all(&debian)?;
    let size_kib = bytes_under(&stage)?.div_ceil(1024);
    fs::write(
        debian.join("control"),
        CONTROL
            .replace("{version}", VERSION)
            .replace("{size}", &size_kib.to_string())
            .replace("{slurm}", &slurm_version()?),
    )?;
    fs::write(
        debian.join("conffiles"),
        "/etc/hocus/agent.toml\n/etc/slurm/plugstack.conf.d/hocus.conf\n",
    )?;
    for (name, text) in [("postinst", POSTINST), ("prerm", PRERM), ("postrm", POSTRM)] {
        fs::write(debian.join(name), text)?;
        fs::set_permissions(debian.join(name), fs::Permissions::from_mode(0o755))?;
    }
    let deb = out.join(format!("{NAME}_{VERSION}_amd64.deb"));
    status(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&stage)
            .arg(&deb),
    )?;
    println!("package: {}", deb.display());
    Ok(deb)
}

/// The bytes of the files under `dir`.
fn bytes_under(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            bytes_under(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// The Slurm the plugin is built for (its headers' `SLURM_VERSION_NUMBER`, 0xMMmmuu).
fn slurm_version() -> Result<String> {
    let header = fs::read_to_string("/usr/include/slurm/slurm_version.h")
        .context("reading Slurm's headers (libslurm-dev)")?;
    let number = header
        .lines()
        .find_map(|l| l.trim().strip_prefix("#define SLURM_VERSION_NUMBER"))
        .and_then(|v| u32::from_str_radix(v.trim().trim_start_matches("0x"), 16).ok())
        .context("no SLURM_VERSION_NUMBER in slurm_version.h")?;
    Ok(format!(
        "{}.{:02}.{}",
        number >> 16,
        (number >> 8) & 0xff,
        number & 0xff
    ))
}

fn apt(args: &[&str]) -> Result<()> {
    status(
        Command::new("apt-get")
            .args(["-y", "-q"])
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn check(what: &str, ok: bool) -> Result<()> {
    if !ok {
        bail!("package check failed: {what}");
    }
    println!("package: {what}: ok");
    Ok(())
}

/// A daemon's state of this machine's own (`cargo xtask run` keeps it in /var/lib/hocus
/// and /var/cache/hocus), set aside while the package is tested (its purge removes
/// them) and put back afterwards, whatever happens meanwhile.
pub struct SetAside(Vec<(PathBuf, PathBuf)>);

impl SetAside {
    pub fn take() -> Result<Self> {
        let aside = |d: &str| PathBuf::from(format!("{d}.set-aside-by-the-tests"));
        for d in STATE {
            if aside(d).exists() {
                bail!(
                    "{} holds what an earlier test run set aside of {d} and did not put back (it was killed?): move it back to {d} (or remove it), then run the tests again",
                    aside(d).display()
                );
            }
        }
        let running = Command::new("pgrep").args(["-x", "hocus-agent"]).output();
        if running.is_ok_and(|o| o.status.success()) && STATE.iter().any(|d| Path::new(d).exists())
        {
            bail!(
                "a hocus-agent runs on this machine and keeps its state in {}: the package test would purge it. Stop that daemon first",
                STATE.join(" and ")
            );
        }
        let mut taken = SetAside(Vec::new());
        for d in STATE {
            if Path::new(d).exists() {
                fs::rename(d, aside(d))
                    .with_context(|| format!("setting {d} aside for the package test"))?;
                println!("package: {d} set aside as {} meanwhile", aside(d).display());
                taken.0.push((PathBuf::from(d), aside(d)));
            }
        }
        Ok(taken)
    }
}

impl Drop for SetAside {
    fn drop(&mut self) {
        for (d, aside) in &self.0 {
            // What the test's install left there (its purge removes it; a failed run
            // may not have got that far).
            let _ = fs::remove_dir_all(d);
            match fs::rename(aside, d) {
                Ok(()) => println!("package: {} put back", d.display()),
                Err(e) => eprintln!(
                    "package: could not put {} back as {} ({e}): move it back by hand",
                    aside.display(),
                    d.display()
                ),
            }
        }
    }
}

/// Installs `deb` as an admin would and checks what it left: every file in place, the
/// binary runs, the daemon neither started nor enabled. State of this machine's own
/// daemon must have been set aside first ([`SetAside`]).
pub fn install(deb: &Path) -> Result<()> {
    apt(&["install", "--reinstall", &deb.display().to_string()])?;
    let listed = output(Command::new("dpkg").args(["-L", NAME]))?;
    for file in [
        AGENT,
        PLUGIN,
        "/lib/systemd/system/hocus-agent.service",
        "/etc/hocus/agent.toml",
        "/etc/slurm/plugstack.conf.d/hocus.conf",
        "/usr/share/man/man1/hocus-agent.1.gz",
        "/usr/share/man/man1/hocus-agent-run.1.gz",
        "/usr/share/bash-completion/completions/hocus-agent",
        "/usr/share/zsh/vendor-completions/_hocus-agent",
        "/usr/share/doc/hocus/README.md",
    ] {
        check(
            &format!("{file} installed"),
            listed.lines().any(|l| l == file) && Path::new(file).exists(),
        )?;
    }
    // Stopping or restarting the unit must leave the partial copies' guard running.
    let unit = fs::read_to_string("/lib/systemd/system/hocus-agent.service")?;
    check(
        "the unit stops the daemon only (KillMode=process)",
        unit.lines().any(|l| l.trim() == "KillMode=process"),
    )?;
    let version = output(Command::new(AGENT).arg("--version"))?;
    check("hocus-agent --version", version.contains(VERSION))?;
    check(
        "the daemon is not enabled",
        !Path::new("/etc/systemd/system/multi-user.target.wants/hocus-agent.service").exists(),
    )?;
    let running = Command::new("pgrep")
        .args(["-x", "hocus-agent"])
        .output()
        .is_ok_and(|o| o.status.success());
    check("the daemon is not started", !running)?;
    Ok(())
}

/// Removes the package (the cache and the profiles stay), then purges it (they go).
pub fn remove() -> Result<()> {
    let marker = Path::new(STATE[1]).join("kept-by-remove");
    fs::create_dir_all(STATE[1])?;
    fs::write(&marker, "a cache file")?;
    apt(&["remove", NAME])?;
    check("remove: the binary is gone", !Path::new(AGENT).exists())?;
    check("remove: the cache stays", marker.exists())?;
    check(
        "remove: the configuration stays",
        Path::new("/etc/hocus/agent.toml").exists(),
    )?;
    apt(&["purge", NAME])?;
    check(
        "purge: the cache and the state are gone",
        STATE.iter().all(|d| !Path::new(d).exists()),
    )?;
    check(
        "purge: the configuration is gone",
        !Path::new("/etc/hocus/agent.toml").exists(),
    )
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
