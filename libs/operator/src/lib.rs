#![doc = include_str!("../README.md")]

pub mod ops;
