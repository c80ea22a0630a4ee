//! The code's layout as docs/architecture.md and the README promise it, checked by
//! this crate's unit tests (so by every `cargo xtask test`):
//!
//! - each folder of `hocus-agent/src` imports (`crate::...`) only the folders its row's
//!   "may use" names, and its `mod.rs` says the same;
//! - the map names every module of the agent and of the kernel side, in its folder's
//!   row, and names no module that is not there;
//! - the thread table names every thread (and process) the daemon names, and no other;
//! - the README's count of the kernel side's programs is the count in the code.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

/// A folder's row of a table: its first cell as written, its name (`cache`), what it
/// owns, what it may use.
#[derive(Debug)]
pub struct Row {
    pub key: String,
    pub name: String,
    pub owns: String,
    pub may_use: String,
}

/// The rows of the markdown table that follows the line holding `heading` in `doc`.
pub fn table(doc: &str, heading: &str) -> Result<Vec<Row>> {
    let start = doc
        .find(heading)
        .with_context(|| format!("no {heading:?} in the doc"))?;
    let rows = doc[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            Row {
                key: cells[0].to_owned(),
                name: cells[0].trim_matches('`').trim_end_matches('/').to_owned(),
                owns: cells.get(1).copied().unwrap_or_default().to_owned(),
                may_use: cells.get(2).copied().unwrap_or_default().to_owned(),
            }
        })
        .collect();
    Ok(rows)
}

/// The backticked words of `text` (`` `a` `` gives `a`).
pub fn ticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// What a "may use" cell allows, of the folders `order` (bottom up) for the folder at
/// `at`: "everything below" (the folders before it), "everything", or the folders it
/// names.
pub fn allowed(may_use: &str, order: &[String], at: usize) -> BTreeSet<String> {
    if may_use.starts_with("everything below") {
        order[..at].iter().cloned().collect()
    } else if may_use.starts_with("everything") {
        order.iter().cloned().collect()
    } else {
        ticked(may_use)
            .into_iter()
            .filter(|w| order.iter().any(|o| o == w))
            .map(str::to_owned)
            .collect()
    }
}

/// The top modules a Rust file reaches through `crate::` (`use crate::{a, b::c}` gives
/// `a` and `b`), comments left out.
pub fn crate_uses(source: &str) -> BTreeSet<String> {
    let code: String = source
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `hocus_crate::`, not ours
        }
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level names: at depth 0, what starts each item.
            let (mut depth, mut item_start) = (0, true);
            let mut word = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if (c.is_alphanumeric() || c == '_') && item_start && depth == 0 => {
                        word.push(c)
                    }
                    _ => {
                        if !word.is_empty() {
                            found.insert(std::mem::take(&mut word));
                            item_start = false;
                        }
                    }
                }
            }
        } else {
            let word: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !word.is_empty() {
                found.insert(word);
            }
        }
    }
    found
}

/// Every `.rs` file below `dir`, by path relative to it.
pub fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p.strip_prefix(dir)?.to_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The modules a folder's files make, as the map names them: a file's stem, a
/// subfolder's name (its `mod.rs`); the folder's own `mod.rs` and test files are not
/// modules of their own to name.
pub fn modules(files: &[PathBuf]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for f in files {
        let parts: Vec<String> = f
            .iter()
            .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
            .collect();
        for p in &parts[..parts.len() - 1] {
            names.insert(p.clone());
        }
        let last = parts.last().expect("a file has a name");
        if last != "mod" && last != "tests" {
            names.insert(last.clone());
        }
    }
    names
}

/// Where a layering rule is broken: `folder/file.rs` uses `crate::x`, which its row
/// does not allow.
pub fn layering_breaks(src: &Path, doc: &str) -> Result<Vec<String>> {
    let rows = table(doc, "## The agent's folders, bottom up")?;
    let order: Vec<String> = rows.iter().map(|r| r.name.clone()).collect();
    let mut breaks = Vec::new();
    for (at, row) in rows.iter().enumerate() {
        let may = allowed(&row.may_use, &order, at);
        let dir = src.join(&row.name);
        // The folder's mod.rs says the same as the table.
        let header = fs::read_to_string(dir.join("mod.rs"))?;
        let says = header
            .lines()
            .find_map(|l| l.strip_prefix("//! May use: "))
            .with_context(|| format!("{}/mod.rs has no \"//! May use:\" line", row.name))?;
        if allowed(says, &order, at) != may {
            breaks.push(format!(
                "{}/mod.rs says it may use {says:?}, the map {:?}",
                row.name, row.may_use
            ));
        }
        for f in rust_files(&dir)? {
            let source = fs::read_to_string(dir.join(&f))?;
            for used in crate_uses(&source) {
                if used != row.name && order.contains(&used) && !may.contains(&used) {
                    breaks.push(format!(
                        "{}/{} uses crate::{used}, which {}/ may not use (may use: {})",
                        row.name,
                        f.display(),
                        row.name,
                        row.may_use
                    ));
                }
            }
        }
    }
    Ok(breaks)
}

/// Modules the map leaves out, and modules it names that are not there: each folder's
/// row (the keeper's table for `daemon/keeper`) against the folder's files.
pub fn map_gaps(src: &Path, rows: &[Row], skip: &[&str]) -> Result<Vec<String>> {
    let mut gaps = Vec::new();
    for row in rows {
        let dir = src.join(&row.name);
        let files = if dir.is_dir() {
            rust_files(&dir)?
        } else if dir.with_extension("rs").is_file() {
            Vec::new()
        } else {
            gaps.push(format!("the map names {}, which is not there", row.name));
            continue;
        };
        // A folder of `skip` is named, its files are another table's.
        let (elsewhere, here): (Vec<PathBuf>, Vec<PathBuf>) = files
            .into_iter()
            .partition(|f| skip.iter().any(|s| f.starts_with(s)));
        let mut have = modules(&here);
        have.extend(
            modules(&elsewhere)
                .into_iter()
                .filter(|m| skip.contains(&m.as_str())),
        );
        let named: BTreeSet<&str> = ticked(&row.owns)
            .into_iter()
            .map(|w| w.trim_end_matches('/').trim_end_matches(".rs"))
            .collect();
        for m in &have {
            if !named.contains(m.as_str()) {
                gaps.push(format!("{}/: the map does not name {m}", row.name));
            }
        }
        for w in named {
            let module_like = !w.is_empty()
                && w != "mod"
                && w.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            if module_like && !have.contains(w) {
                gaps.push(format!(
                    "{}/: the map names {w}, which is not a module there",
                    row.name
                ));
            }
        }
    }
    Ok(gaps)
}

/// The names the daemon gives its threads and processes (`hocus-copy-{i}` as
/// `hocus-copy-N`), from its sources.
pub fn thread_names(src: &Path) -> Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for f in rust_files(src)? {
        if f.ends_with("tests.rs") {
            continue;
        }
        let source = fs::read_to_string(src.join(&f))?;
        let code = source.split("#[cfg(test)]").next().unwrap_or_default();
        for (i, _) in code.match_indices("\"hocus-") {
            let before = &code[i.saturating_sub(40)..i];
            let names_a_thread = before.contains(".name(")
                || before.contains("pool_thread(")
                || before.contains("PR_SET_NAME");
            if !names_a_thread {
                continue;
            }
            let literal: String = code[i + 1..].chars().take_while(|c| *c != '"').collect();
            names.insert(literal.replace("{i}", "N"));
        }
    }
    Ok(names)
}

/// The thread names the map's thread table names.
pub fn documented_threads(doc: &str) -> Result<BTreeSet<String>> {
    let rows = table(doc, "## Threads and tasks")?;
    Ok(rows
        .iter()
        .flat_map(|r| {
            ticked(&r.key)
                .into_iter()
                .chain(ticked(&r.owns))
                .filter(|w| w.starts_with("hocus-") && !w.contains(' '))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect())
}

/// The kernel side's programs by kind of attachment (`tracepoint`, `fentry`, ...).
pub fn programs(ebpf_src: &Path) -> Result<BTreeMap<String, usize>> {
    let mut kinds = BTreeMap::new();
    for f in rust_files(ebpf_src)? {
        for line in fs::read_to_string(ebpf_src.join(f))?.lines() {
            let Some(attr) = line.trim().strip_prefix("#[") else {
                continue;
            };
            let kind: String = attr
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if PROGRAM_KINDS.contains(&kind.as_str()) {
                *kinds.entry(kind).or_default() += 1;
            }
        }
    }
    if kinds.is_empty() {
        bail!("no programs in {}", ebpf_src.display());
    }
    Ok(kinds)
}

/// The `docs/NAME.md` files the sources and docs name that are not in the repository.
pub fn missing_docs(workspace: &Path) -> Result<Vec<String>> {
    let mut missing = BTreeSet::new();
    let mut texts = Vec::new();
    let mut todo = vec![workspace.to_owned()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d)? {
            let p = e?.path();
            let name = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if p.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "third_party" {
                    todo.push(p);
                }
            } else if name.ends_with(".rs") || name.ends_with(".md") || name.ends_with(".toml") {
                texts.push(p);
            }
        }
    }
    for t in texts {
        let text = fs::read_to_string(&t).unwrap_or_default();
        for (i, _) in text.match_indices("docs/") {
            let name: String = text[i + 5..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            let after = &text[i + 5 + name.len()..];
            if name.chars().any(|c| c.is_ascii_lowercase())
                && after.starts_with(".md")
                && !text[..i].ends_with("shared/")
                && !workspace.join("docs").join(format!("{name}.md")).is_file()
            {
                missing.insert(format!(
                    "{} names docs/{name}.md",
                    t.strip_prefix(workspace)?.display()
                ));
            }
        }
    }
    Ok(missing.into_iter().collect())
}

/// aya-ebpf's attributes that make a program.
const PROGRAM_KINDS: [&str; 8] = [
    "tracepoint",
    "btf_tracepoint",
    "raw_tracepoint",
    "fentry",
    "fexit",
    "kprobe",
    "kretprobe",
    "lsm",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::workspace;

    fn doc(name: &str) -> String {
        fs::read_to_string(workspace().join(name)).unwrap()
    }

    #[test]
    fn each_folder_imports_only_what_its_row_says_it_may_use() {
        let breaks = layering_breaks(
            &workspace().join("hocus-agent/src"),
            &doc("docs/architecture.md"),
        )
        .unwrap();
        assert!(breaks.is_empty(), "{}", breaks.join("\n"));
    }

    #[test]
    fn a_wrong_import_breaks_the_layering() {
        // A copy of the agent's sources with one import running back up.
        let dir = tempfile::tempdir().unwrap();
        let src = workspace().join("hocus-agent/src");
        for f in rust_files(&src).unwrap() {
            let to = dir.path().join(&f);
            fs::create_dir_all(to.parent().unwrap()).unwrap();
            fs::copy(src.join(&f), to).unwrap();
        }
        let walk = dir.path().join("cache/walk.rs");
        let source = fs::read_to_string(&walk).unwrap();
        fs::write(
            &walk,
            format!("use crate::{{daemon::keeper, shared}};\n{source}"),
        )
        .unwrap();
        let breaks = layering_breaks(dir.path(), &doc("docs/architecture.md")).unwrap();
        assert_eq!(breaks.len(), 1, "{breaks:?}");
        assert!(
            breaks[0].contains("cache/walk.rs uses crate::daemon"),
            "{breaks:?}"
        );
    }

    #[test]
    fn imports_are_read_whole_grouped_and_alone() {
        let uses = crate_uses(
            "use crate::{\n    cache::walk::{self, Met},\n    shared::identity::Identity,\n};\n\
             let x = crate::place::plan(); // crate::daemon in a comment\nuse hocus_crate::x;",
        );
        let want: BTreeSet<String> = ["cache", "shared", "place"].map(String::from).into();
        assert_eq!(uses, want);
    }

    #[test]
    fn the_map_names_every_module_of_the_agent_and_no_other() {
        let architecture = doc("docs/architecture.md");
        let src = workspace().join("hocus-agent/src");
        let mut gaps = map_gaps(
            &src,
            &table(&architecture, "## The agent's folders, bottom up").unwrap(),
            &["keeper"],
        )
        .unwrap();
        gaps.extend(
            map_gaps(
                &src.join("daemon"),
                &[Row {
                    key: "`keeper/`".into(),
                    name: "keeper".into(),
                    owns: table(&architecture, "### The keeper")
                        .unwrap()
                        .iter()
                        .map(|r| format!("`{}`", r.name))
                        .collect(),
                    may_use: String::new(),
                }],
                &[],
            )
            .unwrap(),
        );
        assert!(gaps.is_empty(), "{}", gaps.join("\n"));
    }

    #[test]
    fn the_map_names_every_module_of_the_kernel_side_and_no_other() {
        let architecture = doc("docs/architecture.md");
        let src = workspace().join("hocus-ebpf/src");
        let rows = table(&architecture, "## The kernel side").unwrap();
        let gaps = map_gaps(&src, &rows, &[]).unwrap();
        assert!(gaps.is_empty(), "{}", gaps.join("\n"));
        // And every top module is a row (main.rs is the crate).
        let files: Vec<PathBuf> = rust_files(&src).unwrap();
        let tops: BTreeSet<String> = files
            .iter()
            .filter(|f| !["main.rs", "lib.rs"].contains(&&*f.to_string_lossy()))
            .map(|f| {
                f.iter()
                    .next()
                    .unwrap()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_owned()
            })
            .collect();
        let named: BTreeSet<String> = rows.iter().map(|r| r.name.clone()).collect();
        assert_eq!(tops, named);
    }

    #[test]
    fn the_thread_table_names_every_thread_and_no_other() {
        let code = thread_names(&workspace().join("hocus-agent/src")).unwrap();
        assert!(
            code.contains("hocus-keeper") && code.contains("hocus-copy-N"),
            "{code:?}"
        );
        let documented = documented_threads(&doc("docs/architecture.md")).unwrap();
        assert_eq!(documented, code);
    }

    #[test]
    fn every_doc_the_project_names_is_in_it() {
        let missing = missing_docs(&workspace()).unwrap();
        assert!(missing.is_empty(), "{}", missing.join("\n"));
    }

    #[test]
    fn the_readme_counts_the_programs_the_kernel_side_has() {
        let kinds = programs(&workspace().join("hocus-ebpf/src")).unwrap();
        let total: usize = kinds.values().sum();
        let functions =
            kinds.get("fentry").copied().unwrap_or(0) + kinds.get("fexit").copied().unwrap_or(0);
        let readme = doc("README.md");
        let said = format!("{total} programs");
        assert!(
            readme.contains(&said),
            "the README should say {said:?} ({kinds:?})"
        );
        let said = format!("{functions} on the NFS client's functions (fentry/fexit)");
        let readme = readme.replace('\n', " ");
        assert!(
            readme.contains(&said),
            "the README should say {said:?} ({kinds:?})"
        );
    }
}
