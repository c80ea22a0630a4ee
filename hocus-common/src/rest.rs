//! `REST`: whether the syscall program is attached.

pub const AWAKE: u32 = 0;
/// Detached: the first activity on a watched mount sends `kind::WAKE`.
pub const RESTING: u32 = 1;
/// Detached, and `kind::WAKE` was sent.
pub const WAKING: u32 = 2;
/// Detached while jobs run whose requests all hit local copies: only a request that
/// reads or changes the mount (`READS_OR_CHANGES`) sends `kind::WAKE`. A path walk's
/// check that a name still stands (a FUSE lookup or getattr after the kernel's entry
/// timeout) is no news: every served job makes them.
pub const RESTING_WITH_JOBS: u32 = 3;
/// Detached while the request programs learn what jobs do on the watched FUSE mounts
/// (`requests`), changes by name included: no tripwire wakes it.
pub const LEARNING_BY_REQUESTS: u32 = 4;

/// FUSE opcodes (`enum fuse_opcode`) that read or change the mount: setattr (4),
/// symlink (6), mknod, mkdir, unlink, rmdir, rename, link (8-13), open, read, write
/// (14-16), setxattr (21), removexattr (24), opendir, readdir (27, 28), create (35),
/// fallocate (43), readdirplus, rename2 (44, 45), copy_file_range (47), tmpfile (51).
pub const READS_OR_CHANGES: u64 = 1 << 4
    | 1 << 6
    | 0b11_1111 << 8
    | 0b111 << 14
    | 1 << 21
    | 1 << 24
    | 0b11 << 27
    | 1 << 35
    | 1 << 43
    | 0b11 << 44
    | 1 << 47
    | 1 << 51;

/// Whether FUSE opcode `opcode` reads or changes the mount.
pub const fn reads_or_changes(opcode: u32) -> bool {
    opcode < 64 && READS_OR_CHANGES >> opcode & 1 == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_served_rest_wakes_on_fuse_requests_that_read_or_change_only() {
        // By name, from the kernel's `enum fuse_opcode`.
        let wakes = [
            4, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 21, 24, 27, 28, 35, 43, 44, 45, 47, 51,
        ];
        for opcode in 0..80 {
            assert_eq!(
                reads_or_changes(opcode),
                wakes.contains(&opcode),
                "{opcode}"
            );
        }
    }
}
