//! Sets the configuration flags of pyo3 (`Py_GIL_DISABLED` for a free-threaded build) for this
//! crate's own `#[cfg]`s.

fn main() {
    pyo3_build_config::use_pyo3_cfgs();
}
