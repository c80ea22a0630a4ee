//! Stage **place**: which files of the working set get a local copy and which of those
//! are pinned, within the budgets (`placement`, `budget`), and `plan`'s simulation of what
//! a placement would save, from costs measured on the mount. Decides; copies nothing.
//!
//! May use: `profile`, `shared`.

pub mod budget;
pub mod placement;
pub mod plan;
