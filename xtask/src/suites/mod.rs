//! What a run of the tests is made of, below the runs themselves (`whole_run` on the
//! host, `vm` in the guests): the test executables, built once (`binaries`), and what
//! a run says of its phases and tests' times (`report`).

pub mod binaries;
pub mod report;

pub use report::Report;
