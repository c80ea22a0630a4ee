//! What a path that came from outside (a profile, a request) must be before the daemon,
//! as root, takes it: absolute, normalised and inside a watched tree.

use std::path::{Path, PathBuf};

use hocus_control::status::Refused;

use hocus_control::profile::Profile;

/// Paths longer than this are refused (Linux's PATH_MAX).
const PATH_MAX: usize = 4096;

/// Why a path that came from outside (a profile, a request) is refused; none when it is
/// absolute, normalised (no empty, `.` or `..` component, no NUL) and inside one of
/// `trees`. Such a path names the same file for root as for the user who wrote it, up to
/// symlinks, which the daemon never follows as root.
pub fn refuse_path(path: &str, trees: &[PathBuf]) -> Option<&'static str> {
    if path.len() > PATH_MAX {
        return Some("is longer than PATH_MAX");
    }
    if path.contains('\0') {
        return Some("contains a NUL byte");
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Some("is not absolute");
    };
    // "/" itself has no component.
    for component in rest.split('/').filter(|_| !rest.is_empty()) {
        match component {
            "" => return Some("has an empty component (// or a trailing /)"),
            "." | ".." => return Some("has a . or .. component"),
            _ => {}
        }
    }
    if !trees.iter().any(|t| Path::new(path).starts_with(t)) {
        return Some("is outside every watched tree");
    }
    None
}

/// Keeps the entries of `profile` whose paths pass [`refuse_path`] for `trees`; returns
/// the others.
pub fn keep_valid(profile: &mut Profile, trees: &[PathBuf]) -> Vec<Refused> {
    let mut refused = Vec::new();
    let mut keep = |path: &str| match refuse_path(path, trees) {
        None => true,
        Some(why) => {
            refused.push(Refused {
                // A path in a message is shown as text, whatever it holds.
                path: path.escape_debug().to_string(),
                why: why.to_owned(),
            });
            false
        }
    };
    profile.files.retain(|f| keep(&f.path));
    profile.missing.retain(|m| keep(&m.path));
    profile.dirs.retain(|d| keep(&d.path));
    refused
}

#[cfg(test)]
pub(super) mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::profile::format::to_json;
    use crate::profile::format::{FORMAT_VERSION, FileEntry, MissingEntry};

    pub fn trees() -> Vec<PathBuf> {
        vec![PathBuf::from("/net/home")]
    }

    #[test]
    fn refuses_paths_that_are_not_absolute_normalised_and_watched() {
        let t = trees();
        assert_eq!(refuse_path("/net/home/a/b.py", &t), None);
        for (path, why) in [
            ("net/home/a.py", "is not absolute"),
            ("/net/home/../../etc/shadow", "has a . or .. component"),
            ("/net/home/./a.py", "has a . or .. component"),
            (
                "/net/home//a.py",
                "has an empty component (// or a trailing /)",
            ),
            (
                "/net/home/a/",
                "has an empty component (// or a trailing /)",
            ),
            ("/net/home/a\0b", "contains a NUL byte"),
            ("/etc/shadow", "is outside every watched tree"),
            ("/net/homework/a.py", "is outside every watched tree"),
            ("/net/home", "is outside every watched tree"),
        ] {
            if path == "/net/home" {
                // The tree itself is inside it.
                assert_eq!(refuse_path(path, &t), None);
                continue;
            }
            assert_eq!(refuse_path(path, &t), Some(why), "{path}");
        }
        assert!(refuse_path(&format!("/net/home/{}", "a".repeat(5000)), &t).is_some());
    }

    #[test]
    fn keeps_the_good_entries_and_names_the_bad() {
        let mut p = Profile {
            files: vec![
                FileEntry {
                    path: "/net/home/ok.py".into(),
                    ..Default::default()
                },
                FileEntry {
                    path: "/net/home/../../etc/passwd".into(),
                    ..Default::default()
                },
            ],
            missing: vec![MissingEntry {
                path: "relative.py".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let refused = keep_valid(&mut p, &trees());
        assert_eq!(p.files.len(), 1);
        assert!(p.missing.is_empty());
        let named: Vec<&str> = refused.iter().map(|r| r.path.as_str()).collect();
        assert_eq!(named, ["/net/home/../../etc/passwd", "relative.py"]);
    }

    /// Path-like strings: components drawn from names, `.`, `..` and empties, joined by
    /// slashes, sometimes relative, sometimes with a NUL.
    fn path_like() -> impl Strategy<Value = String> {
        let component = prop_oneof![
            Just(String::new()),
            Just(".".to_owned()),
            Just("..".to_owned()),
            Just("net".to_owned()),
            Just("home".to_owned()),
            "[a-z\\x00/]{1,6}",
        ];
        (any::<bool>(), prop::collection::vec(component, 0..8)).prop_map(|(absolute, parts)| {
            let joined = parts.join("/");
            if absolute {
                format!("/{joined}")
            } else {
                joined
            }
        })
    }

    proptest! {
        #[test]
        fn what_the_reader_keeps_always_passes_the_checks(paths in prop::collection::vec(path_like(), 0..16)) {
            let profile = Profile {
                version: FORMAT_VERSION,
                files: paths.iter().map(|p| FileEntry { path: p.clone(), ..Default::default() }).collect(),
                missing: paths.iter().map(|p| MissingEntry { path: p.clone(), ..Default::default() }).collect(),
                ..Default::default()
            };
            let mut back = Profile::from_json(&to_json(&profile), Path::new("x.json"), "").unwrap();
            let refused = keep_valid(&mut back, &trees());
            prop_assert_eq!(refused.len() + back.files.len() + back.missing.len(), 2 * paths.len());
            for path in back.files.iter().map(|f| &f.path).chain(back.missing.iter().map(|m| &m.path)) {
                prop_assert_eq!(refuse_path(path, &trees()), None);
                prop_assert!(!Path::new(path).components().any(|c| matches!(c, std::path::Component::ParentDir | std::path::Component::CurDir)));
                prop_assert!(Path::new(path).starts_with("/net/home"));
            }
        }
    }
}
