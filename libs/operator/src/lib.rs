#![doc = include_str!("../README.md")]

pub mod console;
pub mod dlq;
pub mod ops;
