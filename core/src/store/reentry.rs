//! Which leaders' actions this thread is running or polling now, so that an action
//! calling `execute` with its own key fails at once instead of waiting for itself.
//!
//! A frame (store identity, scoped key) is pushed for the duration of each call into
//! a leader's action (making its future, each poll) and popped when that call
//! returns or unwinds. Frames are per thread, so tasks polled one after another on a
//! thread never see each other's; only calls nested inside an action's poll do.

use std::cell::RefCell;

crate::sync::thread_local! {
    static LEADING: RefCell<Frames> = const {
        RefCell::new(Frames {
            depth: 0,
            frames: Vec::new(),
        })
    };
}

struct Frames {
    /// The frames in use are `frames[..depth]`, innermost last; the rest keep their
    /// key buffers for reuse, so entering a frame does not allocate after the first.
    depth: usize,
    frames: Vec<(usize, String)>,
}

/// Marks a leader's action as running on this thread until dropped.
pub(super) struct Frame {
    entered: bool,
}

impl Frame {
    pub(super) fn enter(store: usize, key: &str) -> Frame {
        let entered = LEADING
            .try_with(|l| {
                let mut l = l.borrow_mut();
                let depth = l.depth;
                match l.frames.get_mut(depth) {
                    Some((s, k)) => {
                        *s = store;
                        k.clear();
                        k.push_str(key);
                    }
                    None => l.frames.push((store, key.to_owned())),
                }
                l.depth += 1;
            })
            .is_ok();
        Frame { entered }
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        if self.entered {
            let _ = LEADING.try_with(|l| l.borrow_mut().depth -= 1);
        }
    }
}

/// Whether this thread is inside the action of the leader of `key` on `store`.
pub(super) fn is_leading(store: usize, key: &str) -> bool {
    LEADING
        .try_with(|l| {
            let l = l.borrow();
            l.frames[..l.depth]
                .iter()
                .any(|(s, k)| *s == store && k == key)
        })
        .unwrap_or(false)
}
