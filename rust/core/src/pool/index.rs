//! Index conversions shared by the crate: slot and page numbers as the pools count them
//! (pools are capped at `u32::MAX` slots), and counts as they cross into Python.

/// A count or index as `i64` (slot indices cross into Python as int64).
pub(crate) fn as_i64(x: usize) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// The page of a slot index already checked to be in range.
pub(crate) fn page_of_slot(slot: i64, page_size: usize) -> u32 {
    index_u32(usize::try_from(slot).unwrap_or(usize::MAX) / page_size)
}

/// Converts an index that is known to fit in 32 bits (pools are capped at `u32::MAX`
/// slots; arenas and tables hold fewer entries than that).
pub(crate) fn index_u32(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}
