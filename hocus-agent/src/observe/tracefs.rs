//! tracefs: where it is mounted, and the field offsets of tracepoint records, read from
//! their `format` files so nothing is hard-coded per kernel.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

const MOUNT_POINTS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// The tracefs mount, mounting it at /sys/kernel/tracing when no mount is found.
pub fn root() -> Result<PathBuf> {
    for dir in MOUNT_POINTS {
        if Path::new(dir).join("events").is_dir() {
            return Ok(PathBuf::from(dir));
        }
    }
    let dir = MOUNT_POINTS[0];
    nix::mount::mount(
        Some("tracefs"),
        dir,
        Some("tracefs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .with_context(|| {
        format!("tracefs is not mounted and mounting it at {dir} failed; run `mount -t tracefs none {dir}` as root")
    })?;
    log::info!("mounted tracefs at {dir}");
    Ok(PathBuf::from(dir))
}

/// The fields of one tracepoint record, by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format {
    pub fields: HashMap<String, Field>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub offset: u16,
    pub size: u16,
}

impl Format {
    /// Reads `events/<category>/<name>/format`.
    pub fn read(tracefs: &Path, category: &str, name: &str) -> Result<Self> {
        let path = tracefs
            .join("events")
            .join(category)
            .join(name)
            .join("format");
        let text = fs::read_to_string(&path)
            .with_context(|| format!("reading tracepoint format {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Parses the text of a format file: lines such as
    /// `field:const char * filename; offset:24; size:8; signed:0;` (tab-separated).
    pub fn parse(text: &str) -> Result<Self> {
        let mut fields = HashMap::new();
        for line in text.lines() {
            let line = line.trim();
            let Some(rest) = line.strip_prefix("field:") else {
                continue;
            };
            let mut parts = rest.split(';').map(str::trim);
            let decl = parts.next().unwrap_or_default();
            // The name is the last word of the declaration, without any array suffix.
            let name = decl
                .rsplit([' ', '*'])
                .next()
                .unwrap_or_default()
                .split('[')
                .next()
                .unwrap_or_default();
            let (mut offset, mut size) = (None, None);
            for part in parts {
                if let Some(v) = part.strip_prefix("offset:") {
                    offset = v.parse::<u16>().ok();
                } else if let Some(v) = part.strip_prefix("size:") {
                    size = v.parse::<u16>().ok();
                }
            }
            match (name.is_empty(), offset, size) {
                (false, Some(offset), Some(size)) => {
                    fields.insert(name.to_owned(), Field { offset, size });
                }
                _ => bail!("malformed field line: {line:?}"),
            }
        }
        if fields.is_empty() {
            bail!("no fields found");
        }
        Ok(Self { fields })
    }

    pub fn offset(&self, field: &str) -> Result<u16> {
        self.fields
            .get(field)
            .map(|f| f.offset)
            .with_context(|| format!("the record has no field {field:?}"))
    }

    /// Which argument of a `sys_enter_*` record `field` is (0 for the first): the
    /// arguments follow `__syscall_nr`, 8 bytes each.
    pub fn argument_position(&self, field: &str) -> Result<usize> {
        let first = self
            .fields
            .iter()
            .filter(|(name, _)| !name.starts_with("common_") && *name != "__syscall_nr")
            .map(|(_, f)| f.offset)
            .min()
            .context("the record has no arguments")?;
        let at = self.offset(field)?;
        match at.checked_sub(first) {
            Some(d) if d % 8 == 0 && d / 8 < 6 && self.fields[field].size == 8 => {
                Ok(usize::from(d / 8))
            }
            _ => bail!("{field} at offset {at} is not a syscall argument"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENAT: &str = "name: sys_enter_openat
ID: 782
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;
\tfield:int dfd;\toffset:16;\tsize:8;\tsigned:0;
\tfield:const char * filename;\toffset:24;\tsize:8;\tsigned:0;
\tfield:int flags;\toffset:32;\tsize:8;\tsigned:0;
\tfield:umode_t mode;\toffset:40;\tsize:8;\tsigned:0;

print fmt: \"dfd: 0x%08lx, filename: 0x%08lx\", ((unsigned long)(REC->dfd))
";

    #[test]
    fn parses_syscall_format() {
        let f = Format::parse(OPENAT).unwrap();
        assert_eq!(f.offset("__syscall_nr").unwrap(), 8);
        assert_eq!(f.offset("dfd").unwrap(), 16);
        assert_eq!(f.offset("filename").unwrap(), 24);
        assert_eq!(f.fields["filename"].size, 8);
        assert_eq!(f.offset("mode").unwrap(), 40);
        assert!(f.offset("how").is_err());
        assert_eq!(f.argument_position("dfd").unwrap(), 0);
        assert_eq!(f.argument_position("mode").unwrap(), 3);
        assert!(f.argument_position("__syscall_nr").is_err());
    }

    #[test]
    fn parses_arrays_and_pointers() {
        let f = Format::parse(
            "\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\tfield:struct open_how *how;\toffset:32;\tsize:8;\tsigned:0;\n",
        )
        .unwrap();
        assert_eq!(f.offset("comm").unwrap(), 8);
        assert_eq!(f.offset("how").unwrap(), 32);
    }

    #[test]
    fn rejects_garbage() {
        assert!(Format::parse("name: x\nformat:\n").is_err());
        assert!(Format::parse("\tfield:int x;\toffset:abc;\tsize:4;\n").is_err());
    }
}
