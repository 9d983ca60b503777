//! Bytes allocated by one thread, counted by a global allocator that a test file installs itself:
//!
//! ```ignore
//! #[global_allocator]
//! static GLOBAL: common::measure::Measuring = common::measure::Measuring;
//! ```

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    sync::atomic::{AtomicBool, Ordering},
};

/// Counts the bytes the measuring thread allocates, so that the other tests of this file, running
/// beside it, are not counted.
pub struct Measuring;

thread_local! {
    static MEASURED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Whether any thread measures: the other threads then skip the thread-local lookup.
static ANY: AtomicBool = AtomicBool::new(false);

fn count(bytes: usize) {
    if ANY.load(Ordering::Relaxed) {
        MEASURED.with(|m| {
            if let Some(total) = m.get() {
                m.set(Some(total + bytes));
            }
        });
    }
}

unsafe impl GlobalAlloc for Measuring {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// What `f` returns, and the bytes this thread allocated while it ran.
pub fn bytes_allocated<T>(f: impl FnOnce() -> T) -> (T, usize) {
    MEASURED.with(|m| m.set(Some(0)));
    ANY.store(true, Ordering::SeqCst);
    let out = f();
    let bytes = MEASURED.with(|m| m.take()).unwrap_or(0);
    (out, bytes)
}

/// The most memory the process `pid` has held so far, in bytes (its `VmHWM`).
pub fn peak_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM in /proc/PID/status");
    kb * 1024
}
