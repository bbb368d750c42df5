//! Workload generators shared by the criterion benches (see `benches/radix.rs`).
