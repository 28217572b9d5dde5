//! # switch: the sans-IO core of sandirect
//!
//! (Architecture essay: see the module docs of [`session`], [`wire`] and [`mr_cache`].)
#![no_std]
#![forbid(unsafe_code)]

extern crate alloc;
#[cfg(test)]
extern crate std;

pub mod mr_cache;
pub mod session;
pub mod wire;
