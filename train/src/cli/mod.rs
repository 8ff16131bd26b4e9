//! The commands, one file per group: `train`; `bench`; `cluster`; `plan` and `reshard` (`layout`);
//! `generate`, `eval`, `prepare` and `export` (`inspect`); `launch`; `selftest`.

pub mod bench;
pub mod cluster;
pub mod inspect;
pub mod launch;
pub mod layout;
pub mod selftest;
pub mod train;
