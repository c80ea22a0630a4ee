//! Empty library target: lets hocus-agent name this crate as a build dependency, so cargo
//! rebuilds the agent (and with it the embedded eBPF object) when these programs change.
#![no_std]
