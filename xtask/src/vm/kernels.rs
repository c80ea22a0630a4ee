//! The kernels the rig boots: Debian's stock kernel packages, fetched from Debian's
//! archive by suite (a private apt state under `target/vm/apt/`, so the machine's own
//! apt is untouched), unpacked and indexed (`depmod`) under `target/vm/kernels/`. The
//! guest sees the checkout, so a kernel kept there boots as is.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::host::{status, target_dir};

/// A kernel series a cluster runs, and the Debian release that ships it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Series {
    /// What users call it, and what `--kernel` takes: `5.10`, `6.1`, `6.12`.
    pub name: &'static str,
    pub distribution: &'static str,
    suite: &'static str,
    /// Emulate all the guest's CPUs on one host thread (QEMU's single-threaded TCG).
    /// Every series needs it: with one thread per CPU, a CPU that meets the int3 of a
    /// jump label being patched (`text_poke_bp`, e.g. when a program is attached at
    /// `sys_exit`, or a test enables the NFS client's trace events) keeps running QEMU's
    /// stale translation of it after the patch, and the int3 handler, seeing the byte
    /// gone, retries it forever: 5.10 at once, 6.1 now and then (docs/kernels.md).
    pub one_emulation_thread: bool,
}

/// Debian 11, 12 and 13: the stock kernels of today's clusters besides this machine's.
pub const SERIES: [Series; 3] = [
    Series {
        name: "5.10",
        distribution: "Debian 11 (bullseye)",
        suite: "bullseye",
        one_emulation_thread: true,
    },
    Series {
        name: "6.1",
        distribution: "Debian 12 (bookworm)",
        suite: "bookworm",
        one_emulation_thread: true,
    },
    Series {
        name: "6.12",
        distribution: "Debian 13 (trixie)",
        suite: "trixie",
        one_emulation_thread: true,
    },
];

pub fn series(name: &str) -> Result<Series> {
    SERIES
        .iter()
        .copied()
        .find(|s| s.name == name)
        .with_context(|| {
            format!(
                "no kernel {name} in the rig: it boots {}",
                SERIES.map(|s| s.name).join(", ")
            )
        })
}

/// An unpacked kernel: its image and the module tree the guest loads from.
pub struct Kernel {
    pub series: Series,
    /// The Debian package it came from (`linux-image-6.1.0-56-amd64`).
    pub package: String,
    /// `uname -r` in the guest.
    pub release: String,
    pub image: PathBuf,
}

fn root() -> PathBuf {
    target_dir().join("vm")
}

/// The newest kernel of `series` in the archive, fetched and unpacked unless already
/// here; with `refresh`, the archive is asked even when one is.
pub fn fetch(series: Series, refresh: bool) -> Result<Kernel> {
    if !refresh {
        if let Some(k) = cached(series)? {
            return Ok(k);
        }
    }
    let apt = Apt::new(series)?;
    apt.update()?;
    let package = apt.newest_image()?;
    let dir = root().join("kernels").join(&package);
    if let Some(k) = unpacked(series, &package, &dir)? {
        return Ok(k);
    }
    println!("vm: fetching {package} ({})", series.distribution);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let deb = apt.download(&package, &dir)?;
    status(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir))?;
    fs::remove_file(&deb)?;
    // Newer packages keep their modules under usr/ (merged /usr).
    let (base, release) = module_tree(&dir)?;
    status(Command::new("depmod").arg("-b").arg(&base).arg(&release))?;
    fs::write(dir.join(READY), &release)?;
    unpacked(series, &package, &dir)?.context("the unpacked kernel has no image")
}

/// Written once a kernel is unpacked and indexed.
const READY: &str = ".ready";

/// The newest kernel of `series` already here.
fn cached(series: Series) -> Result<Option<Kernel>> {
    let dir = root().join("kernels");
    let Ok(entries) = fs::read_dir(&dir) else {
        return Ok(None);
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let package = e.file_name().to_string_lossy().into_owned();
        if let Some(k) = unpacked(series, &package, &e.path())? {
            found.push(k);
        }
    }
    found.sort_by(|a, b| version_order(&a.release, &b.release));
    Ok(found.pop())
}

fn unpacked(series: Series, package: &str, dir: &Path) -> Result<Option<Kernel>> {
    let Ok(release) = fs::read_to_string(dir.join(READY)) else {
        return Ok(None);
    };
    let belongs = release
        .strip_prefix(series.name)
        .is_some_and(|rest| rest.starts_with(['.', '-']));
    if !belongs {
        return Ok(None);
    }
    let image = dir.join("boot").join(format!("vmlinuz-{release}"));
    if !image.is_file() {
        return Ok(None);
    }
    Ok(Some(Kernel {
        series,
        package: package.to_owned(),
        release,
        image,
    }))
}

/// Where the package put its modules: the base `depmod -b` takes, and the release.
fn module_tree(dir: &Path) -> Result<(PathBuf, String)> {
    for base in [dir.join("usr"), dir.to_owned()] {
        let modules = base.join("lib/modules");
        let first = fs::read_dir(&modules).ok().and_then(|mut e| e.next());
        if let Some(e) = first {
            return Ok((base, e?.file_name().to_string_lossy().into_owned()));
        }
    }
    bail!("{} holds no lib/modules", dir.display())
}

/// Orders kernel releases by their numbers (`6.1.0-56` after `6.1.0-9`).
fn version_order(a: &str, b: &str) -> std::cmp::Ordering {
    let numbers = |s: &str| -> Vec<u64> {
        s.split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    numbers(a).cmp(&numbers(b))
}

/// apt with a sources list of one suite and state of its own.
struct Apt {
    series: Series,
    dir: PathBuf,
}

impl Apt {
    fn new(series: Series) -> Result<Self> {
        let dir = root().join("apt").join(series.suite);
        fs::create_dir_all(dir.join("lists/partial"))?;
        fs::create_dir_all(dir.join("cache/archives/partial"))?;
        let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
        let suite = series.suite;
        fs::write(
            dir.join("sources.list"),
            format!(
                "deb [signed-by={keyring}] http://deb.debian.org/debian {suite} main\n\
                 deb [signed-by={keyring}] http://deb.debian.org/debian-security {suite}-security main\n"
            ),
        )?;
        Ok(Self { series, dir })
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let d = self.dir.display();
        cmd.args(["-o", &format!("Dir::Etc::sourcelist={d}/sources.list")])
            .args(["-o", "Dir::Etc::sourceparts=-"])
            .args(["-o", &format!("Dir::State::Lists={d}/lists")])
            .args(["-o", &format!("Dir::Cache={d}/cache")])
            // Downloads land in our own folder, which apt's sandbox user cannot write.
            .args(["-o", "APT::Sandbox::User=root"])
            .args(["-o", "Debug::NoLocking=1"]);
        cmd
    }

    fn update(&self) -> Result<()> {
        println!(
            "vm: asking Debian's archive for {}'s kernels",
            self.series.suite
        );
        let out = self
            .command("apt-get")
            .args(["-q", "update"])
            .output()
            .context("running apt-get")?;
        if !out.status.success() {
            bail!(
                "apt-get update for {} failed:\n{}",
                self.series.suite,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// The image package the suite's `linux-image-amd64` depends on (its newest
    /// version: the security suite's, when it has one).
    fn newest_image(&self) -> Result<String> {
        let out = self
            .command("apt-cache")
            .args(["depends", "linux-image-amd64"])
            .output()
            .context("running apt-cache")?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .map(str::trim)
            .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
            .map(str::to_owned)
            .with_context(|| {
                format!(
                    "{} has no linux-image-amd64 that names a kernel: {text}",
                    self.series.suite
                )
            })
    }

    fn download(&self, package: &str, into: &Path) -> Result<PathBuf> {
        status(
            self.command("apt-get")
                .args(["-q", "download", package])
                .current_dir(into),
        )?;
        fs::read_dir(into)?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .with_context(|| format!("apt-get download {package} left no .deb"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_order_by_number() {
        use std::cmp::Ordering::*;
        assert_eq!(version_order("6.1.0-56-amd64", "6.1.0-9-amd64"), Greater);
        assert_eq!(
            version_order("6.12.9+deb13-amd64", "6.12.118+deb13-amd64"),
            Less
        );
        assert!(series("6.1").is_ok());
        assert!(series("4.19").is_err());
    }
}
