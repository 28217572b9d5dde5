//! placeholder, being written
#![forbid(unsafe_code)]
