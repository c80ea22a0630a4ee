//! Open files and where they lie: a descriptor's `struct file`, the mount it was opened
//! through, its dentry, a dentry's parent and name, an inode's number.

use hocus_common::{InodeKey, kfunc};

use super::{Typed, current_task, field, offset};

/// The mount a place was reached through: its root directory and its superblock.
#[derive(Clone, Copy)]
pub struct Mount {
    pub root: u64,
    pub sb: u64,
}

impl Mount {
    /// A `struct vfsmount` known by address: mnt_root then mnt_sb, read at once
    /// (adjacent, checked by the agent).
    fn at(mnt: u64) -> Option<Self> {
        let [root, sb] = field::<[u64; 2]>(mnt, offset(|o| &o.vfsmount_root))?;
        Some(Self { root, sb })
    }

    pub fn of(mnt: Typed) -> Self {
        let at = offset(|o| &o.vfsmount_root);
        Self {
            root: Typed(mnt.read(at)).address(),
            sb: Typed(mnt.read(at + 8)).address(),
        }
    }
}

/// An open `struct file`: typed where the kernel can cast (`kfunc::RDONLY_CAST`), its
/// fields then read with plain loads; else only its address, its fields read with the
/// helper. Opens of followed processes come here, to be turned away by where they lie.
#[derive(Clone, Copy)]
pub struct File(Typed);

/// Whether the agent made the cast placeholders calls of the kfunc: a constant to the
/// verifier, which then never looks at the other way.
fn can_cast() -> bool {
    offset(|o| &o.file_pointer_type) != 0
}

/// The object at `address` as BTF type `btf_id` (`bpf_rdonly_cast`).
fn cast(address: u64, btf_id: u32) -> Typed {
    // SAFETY: a helper number the agent rewrites into a call of the kfunc, which only
    // retypes its first argument; taken only where it did (`can_cast`).
    unsafe {
        let cast: unsafe extern "C" fn(u64, u32) -> u64 =
            core::mem::transmute(kfunc::RDONLY_CAST as usize);
        Typed(cast(address, btf_id))
    }
}

/// The file descriptor `fd` of the current process holds now. The table is an array of
/// pointers, which the verifier types as a number: its slot is cast to a struct whose
/// first field points to a file. (The table built into `files_struct` is typed, but
/// almost no process uses it: a child gets a grown table when its parent has a high
/// descriptor open, a shell's fd 255, and keeps it.) No check against max_fds: `fd` was
/// valid at this syscall (a table only grows), and a wrong read lands on no known
/// superblock anyway.
pub fn file_at(fd: u32) -> Option<File> {
    let files = current_task().follow(offset(|o| &o.task_files))?;
    let fdt = files.follow(offset(|o| &o.files_fdt))?;
    let slot = fdt.read::<u64>(offset(|o| &o.fdt_fd)) + u64::from(fd) * 8;
    let file = if can_cast() {
        cast(slot, offset(|o| &o.file_pointer_type)).follow(0)?
    } else {
        Typed(field::<u64>(slot, 0).filter(|&f| f != 0)?)
    };
    Some(File(file))
}

impl File {
    /// A typed `struct file`, a hooked function's argument: kept typed where files are
    /// (`can_cast`), else its address.
    pub fn of(file: Typed) -> Self {
        if can_cast() {
            Self(file)
        } else {
            Self(Typed(file.address()))
        }
    }

    /// Its address as a plain number, which identifies it in `OPEN_FILES`.
    pub fn address(self) -> u64 {
        if can_cast() {
            self.0.address()
        } else {
            self.0.0
        }
    }

    /// Where it lies: the mount it was opened through, and its dentry. f_path is a struct
    /// path: mnt then dentry (checked by the agent).
    pub fn place(self) -> Option<(Mount, Dentry)> {
        let at = offset(|o| &o.file_mnt);
        if can_cast() {
            let mnt = self.0.follow(at)?;
            return Some((Mount::of(mnt), Dentry::of(Typed(self.0.read(at + 8)))));
        }
        let [mnt, dentry] = field::<[u64; 2]>(self.0.0, at)?;
        Some((Mount::at(mnt)?, Dentry(dentry)))
    }
}

/// A directory entry: typed where files are (`can_cast`), its fields then read with
/// plain loads as `locate` walks up; else its address, read with the helper. One way or
/// the other for the whole program, so that the verifier follows one walk.
#[derive(Clone, Copy)]
pub struct Dentry(pub u64);

impl Dentry {
    /// A typed dentry (a working directory, a typed file's), kept typed where files are.
    pub fn of(d: Typed) -> Self {
        if can_cast() {
            Self(d.0)
        } else {
            Self(d.address())
        }
    }

    /// The dentry at `address`, a plain number (found by its inline name), typed as BTF
    /// type `btf_id` (`struct dentry`) where files are.
    pub fn at(address: u64, btf_id: u32) -> Self {
        if can_cast() {
            Self(cast(address, btf_id).0)
        } else {
            Self(address)
        }
    }

    /// Its address as a plain number.
    pub fn address(self) -> u64 {
        if can_cast() {
            Typed(self.0).address()
        } else {
            self.0
        }
    }

    /// Its parent, and the length and address of its name.
    pub fn up(self) -> Option<(Dentry, u32, u64)> {
        let parent_at = offset(|o| &o.dentry_parent);
        let (len_at, name_at) = (offset(|o| &o.dentry_name_len), offset(|o| &o.dentry_name));
        if can_cast() {
            let d = Typed(self.0);
            return Some((Self(d.read(parent_at)), d.read(len_at), d.read(name_at)));
        }
        Some((
            Self(field(self.0, parent_at)?),
            field(self.0, len_at)?,
            field(self.0, name_at)?,
        ))
    }
}

/// The page cache key of what a descriptor is open on: its superblock's device and its
/// inode's number.
pub fn inode_of(mount: Mount, dentry: Dentry) -> Option<InodeKey> {
    let inode: u64 = field(dentry.address(), offset(|o| &o.dentry_inode))?;
    Some(InodeKey {
        dev: field(mount.sb, offset(|o| &o.sb_dev))?,
        _pad: 0,
        ino: field(inode, offset(|o| &o.inode_ino))?,
    })
}
