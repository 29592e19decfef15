//! The store's table: text keys to entries, laid out for millions of entries.
//!
//! A bucket holds the key's hash and a pointer to the boxed `(key, value)`, 16 bytes,
//! so that a table at half load (right after it doubles) wastes 16 bytes per empty
//! bucket rather than the whole entry, and growing rehashes from the stored hashes
//! without reading a single key.

use std::hash::BuildHasher;
use std::sync::Arc;

use hashbrown::HashTable;

/// A bucket: the key's hash, and the key with its value.
type Bucket<T> = (u64, Box<(Arc<str>, T)>);

pub(crate) struct KeyMap<T> {
    table: HashTable<Bucket<T>>,
    hasher: foldhash::quality::RandomState,
}

impl<T> KeyMap<T> {
    pub(crate) fn new() -> Self {
        KeyMap {
            table: HashTable::new(),
            hasher: Default::default(),
        }
    }

    /// The hash of `key`, to pass to the `_h` methods.
    #[inline]
    pub(crate) fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    #[inline]
    pub(crate) fn get_h(&self, h: u64, key: &str) -> Option<&T> {
        self.table
            .find(h, |(eh, e)| *eh == h && &*e.0 == key)
            .map(|(_, e)| &e.1)
    }

    pub(crate) fn get(&self, key: &str) -> Option<&T> {
        self.get_h(self.hash(key), key)
    }

    #[inline]
    pub(crate) fn get_mut_h(&mut self, h: u64, key: &str) -> Option<&mut T> {
        self.table
            .find_mut(h, |(eh, e)| *eh == h && &*e.0 == key)
            .map(|(_, e)| &mut e.1)
    }

    pub(crate) fn remove_h(&mut self, h: u64, key: &str) -> Option<T> {
        match self.table.find_entry(h, |(eh, e)| *eh == h && &*e.0 == key) {
            Ok(entry) => Some(entry.remove().0 .1 .1),
            Err(_) => None,
        }
    }

    pub(crate) fn remove(&mut self, key: &str) -> Option<T> {
        self.remove_h(self.hash(key), key)
    }

    /// Keeps only the entries for which `keep` is true.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        self.table.retain(|(_, e)| keep(&e.1));
    }

    /// Inserts `key`, which must be absent, with hash `h`.
    pub(crate) fn insert_new_h(&mut self, h: u64, key: Arc<str>, value: T) {
        self.table
            .insert_unique(h, (h, Box::new((key, value))), |(eh, _)| *eh);
    }
}
