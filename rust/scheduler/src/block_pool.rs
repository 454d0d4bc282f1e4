//! BlockPool: the allocator of paged KV-cache blocks, with prefix caching.
//!
//! Block 0 is the null block: never allocated, it pads block tables. Every other block is
//! either in use (ref count > 0) or on the free list (ref count 0), never both.
//!
//! The free list is an intrusive doubly linked list over block ids (`prev`/`next` arrays),
//! ordered for eviction: `allocate` takes the head. A freed block that holds a prefix hash
//! goes to the tail (so cached blocks are evicted least-recently-freed first); a freed block
//! without a hash goes to the head (its content is worthless, reuse it before any cached one).
//!
//! O(1) guarantees (hash-map operations amortized):
//! - `allocate`: pop the head; if it held a hash, evict it (drop the hash-map entry).
//! - `free`: decrement; at zero push to the tail (hashed) or head (unhashed).
//! - `touch`: take another reference; a free cached block is unlinked from the middle of the
//!   free list in O(1) (this is how a prefix hit revives it).
//! - `lookup`: one hash-map probe plus a `block_size` comparison of the stored tokens and
//!   parent hash, so a 64-bit collision never shares a block with different content.
//! - `register`: one hash-map insert plus a `block_size` copy of the tokens.
//! - `num_free`, `num_used`, `num_cached_free`: counters.
//!
//! Only `validate` walks the pool (O(num_blocks)); it exists for tests.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The block that pads block tables; never allocated.
pub const NULL_BLOCK: u32 = 0;
const NIL: u32 = u32::MAX;

/// The parent hash of a sequence's first block: ties the chain to the cache salt and the
/// LoRA adapter (0: none), so requests with different salts or adapters never share a block.
pub fn root_hash(cache_salt: Option<&str>, lora: u32) -> u64 {
    // NOTE: DefaultHasher::new() uses fixed keys, so hashes are stable within a process,
    // which is all an in-memory cache needs.
    let mut h = DefaultHasher::new();
    h.write(b"llmserve-prefix-root");
    // Fixed-width fields first and the salt's length before its bytes: a salt ending in
    // bytes that spell an adapter index must not give another adapter's root.
    h.write_u32(lora);
    match cache_salt {
        Some(salt) => {
            h.write_u8(1);
            h.write_u64(salt.len() as u64);
            h.write(salt.as_bytes());
        }
        None => h.write_u8(0),
    }
    h.finish()
}

/// Chained hash of one full block: depends on every token before it through `parent`.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    h.write_u64(parent);
    for &t in tokens {
        h.write_u32(t);
    }
    h.finish()
}

/// Block hashes are already well mixed; hashing them again would waste time.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    ref_count: Vec<u32>,
    // Intrusive free list.
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    num_free: usize,
    // Prefix cache: per block its hash, its parent's hash and its tokens (for verification).
    hashed: Vec<bool>,
    hash: Vec<u64>,
    parent: Vec<u64>,
    tokens: Vec<u32>,
    cached: HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>,
    num_cached_free: usize,
}

impl BlockPool {
    /// `num_blocks` includes the null block, so `num_blocks - 1` can be allocated.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(num_blocks >= 2, "BlockPool needs the null block and at least one more");
        assert!(num_blocks < NIL as usize, "too many blocks for u32 ids");
        assert!(block_size > 0, "block_size must be positive");
        let mut pool = BlockPool {
            block_size,
            ref_count: vec![0; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            in_free: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            num_free: 0,
            hashed: vec![false; num_blocks],
            hash: vec![0; num_blocks],
            parent: vec![0; num_blocks],
            tokens: vec![0; num_blocks * block_size],
            cached: HashMap::default(),
            num_cached_free: 0,
        };
        for b in 1..num_blocks as u32 {
            pool.push_back(b);
        }
        pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Including the null block.
    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }
    pub fn num_free(&self) -> usize {
        self.num_free
    }
    /// Blocks with ref count > 0 (the null block is never counted).
    pub fn num_used(&self) -> usize {
        self.num_blocks() - 1 - self.num_free
    }
    /// Free blocks still holding a hash: prefix-cache content that survives until evicted.
    pub fn num_cached_free(&self) -> usize {
        self.num_cached_free
    }
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_count[block as usize]
    }
    /// The block's prefix hash, if it is registered.
    pub fn block_hash(&self, block: u32) -> Option<u64> {
        self.hashed[block as usize].then(|| self.hash[block as usize])
    }

    /// Take the least valuable free block (ref count becomes 1), evicting its hash.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if self.hashed[b as usize] {
            self.num_cached_free -= 1;
            self.drop_hash(b);
        }
        self.ref_count[b as usize] = 1;
        Some(b)
    }

    /// Drop one reference. At zero the block joins the free list, keeping its hash.
    pub fn free(&mut self, block: u32) {
        assert_ne!(block, NULL_BLOCK, "the null block is never freed");
        let i = block as usize;
        assert!(self.ref_count[i] > 0, "block {block} freed with ref count 0");
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            if self.hashed[i] {
                self.num_cached_free += 1;
                self.push_back(block);
            } else {
                self.push_front(block);
            }
        }
    }

    /// Take another reference to a block that is in use or sits free in the cache.
    pub fn touch(&mut self, block: u32) {
        assert_ne!(block, NULL_BLOCK, "the null block is never shared");
        let i = block as usize;
        if self.ref_count[i] == 0 {
            self.unlink(block);
            if self.hashed[i] {
                self.num_cached_free -= 1;
            }
        }
        self.ref_count[i] += 1;
    }

    /// The cached block whose hash is `hash`, if its stored parent hash and tokens equal
    /// `parent` and `tokens`. Does not take a reference (see `touch`).
    pub fn lookup(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        let &b = self.cached.get(&hash)?;
        let i = b as usize;
        let stored = &self.tokens[i * self.block_size..(i + 1) * self.block_size];
        (self.parent[i] == parent && stored == tokens).then_some(b)
    }

    /// Record that an in-use, full block holds `tokens` with chained `hash`; returns whether
    /// it was newly registered. False (the block stays as it was) when it already has a hash
    /// or another block already caches this one: the first keeps serving hits, this one is
    /// freed as plain memory.
    pub fn register(&mut self, block: u32, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        let i = block as usize;
        assert!(self.ref_count[i] > 0, "only in-use blocks are registered");
        assert_eq!(tokens.len(), self.block_size, "only full blocks are registered");
        if self.hashed[i] {
            return false;
        }
        if self.cached.contains_key(&hash) {
            return false;
        }
        self.cached.insert(hash, block);
        self.hashed[i] = true;
        self.hash[i] = hash;
        self.parent[i] = parent;
        self.tokens[i * self.block_size..(i + 1) * self.block_size].copy_from_slice(tokens);
        true
    }

    /// Drop a block's hash (its content turned out to be invalid: the step that was to write
    /// it never ran). A free block becomes plain and moves to the head of the free list.
    pub fn forget(&mut self, block: u32) {
        if !self.hashed[block as usize] {
            return;
        }
        self.drop_hash(block);
        if self.ref_count[block as usize] == 0 {
            self.num_cached_free -= 1;
            self.unlink(block);
            self.push_front(block);
        }
    }

    /// Check the free list, counters and hash map against each other. O(num_blocks).
    pub fn validate(&self) -> Result<(), String> {
        let mut count = 0;
        let mut cached = 0;
        let mut prev = NIL;
        let mut b = self.head;
        while b != NIL {
            let i = b as usize;
            if b == NULL_BLOCK {
                return Err("null block on the free list".into());
            }
            if !self.in_free[i] || self.ref_count[i] != 0 {
                return Err(format!("block {b} linked but in_free={} ref={}", self.in_free[i], self.ref_count[i]));
            }
            if self.prev[i] != prev {
                return Err(format!("block {b} has a broken prev link"));
            }
            cached += usize::from(self.hashed[i]);
            count += 1;
            if count > self.num_blocks() {
                return Err("free list has a cycle".into());
            }
            prev = b;
            b = self.next[i];
        }
        if prev != self.tail {
            return Err("free list tail mismatch".into());
        }
        if count != self.num_free {
            return Err(format!("free list holds {count}, counter says {}", self.num_free));
        }
        if cached != self.num_cached_free {
            return Err(format!("{cached} cached free blocks, counter says {}", self.num_cached_free));
        }
        for i in 1..self.num_blocks() {
            if self.in_free[i] == (self.ref_count[i] > 0) {
                return Err(format!("block {i}: in_free={} but ref={}", self.in_free[i], self.ref_count[i]));
            }
        }
        for (&h, &b) in &self.cached {
            if !self.hashed[b as usize] || self.hash[b as usize] != h {
                return Err(format!("hash map entry for block {b} is stale"));
            }
        }
        let hashed = self.hashed.iter().filter(|&&x| x).count();
        if hashed != self.cached.len() {
            return Err(format!("{hashed} hashed blocks but {} map entries", self.cached.len()));
        }
        Ok(())
    }

    fn drop_hash(&mut self, b: u32) {
        let i = b as usize;
        self.hashed[i] = false;
        if self.cached.get(&self.hash[i]) == Some(&b) {
            self.cached.remove(&self.hash[i]);
        }
    }

    fn push_back(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(!self.in_free[i]);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.in_free[i] = true;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(!self.in_free[i]);
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.in_free[i] = true;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.in_free[i]);
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_free[i] = false;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(pool: &BlockPool, v: u32) -> Vec<u32> {
        vec![v; pool.block_size()]
    }

    #[test]
    fn null_block_is_never_allocated() {
        let mut pool = BlockPool::new(4, 2);
        let got: Vec<u32> = std::iter::from_fn(|| pool.allocate()).collect();
        assert_eq!(got, vec![1, 2, 3]);
        assert_eq!(pool.num_free(), 0);
        assert_eq!(pool.num_used(), 3);
        pool.validate().unwrap();
    }

    #[test]
    #[should_panic(expected = "null block")]
    fn freeing_the_null_block_panics() {
        BlockPool::new(4, 2).free(NULL_BLOCK);
    }

    #[test]
    #[should_panic(expected = "ref count 0")]
    fn double_free_panics() {
        let mut pool = BlockPool::new(4, 2);
        let b = pool.allocate().unwrap();
        pool.free(b);
        pool.free(b);
    }

    #[test]
    fn ref_counts_keep_shared_blocks_alive() {
        let mut pool = BlockPool::new(4, 2);
        let b = pool.allocate().unwrap();
        pool.touch(b);
        assert_eq!(pool.ref_count(b), 2);
        pool.free(b);
        assert_eq!(pool.ref_count(b), 1);
        assert_eq!(pool.num_free(), 2);
        pool.free(b);
        assert_eq!(pool.num_free(), 3);
        pool.validate().unwrap();
    }

    #[test]
    fn unhashed_blocks_are_reused_before_cached_ones() {
        let mut pool = BlockPool::new(4, 2);
        let (a, b, c) = (pool.allocate().unwrap(), pool.allocate().unwrap(), pool.allocate().unwrap());
        let root = root_hash(None, 0);
        let toks = full(&pool, 7);
        assert!(pool.register(a, hash_block(root, &toks), root, &toks));
        pool.free(a); // cached: tail
        pool.free(b); // plain: head
        pool.free(c); // plain: head
        assert_eq!(pool.num_cached_free(), 1);
        assert_eq!(pool.allocate(), Some(c));
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(pool.num_cached_free(), 0);
        pool.validate().unwrap();
    }

    #[test]
    fn cached_blocks_are_evicted_in_lru_order() {
        let mut pool = BlockPool::new(4, 2);
        let blocks: Vec<u32> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        let root = root_hash(None, 0);
        let mut hashes = vec![];
        for (k, &b) in blocks.iter().enumerate() {
            let toks = full(&pool, k as u32);
            let h = hash_block(root, &toks);
            assert!(pool.register(b, h, root, &toks));
            hashes.push(h);
        }
        // Free in the order 2, 0, 1: eviction follows that order.
        for &k in &[2usize, 0, 1] {
            pool.free(blocks[k]);
        }
        assert_eq!(pool.num_cached_free(), 3);
        assert_eq!(pool.allocate(), Some(blocks[2]));
        // The evicted block lost its hash; the others still hit.
        assert_eq!(pool.lookup(hashes[2], root, &full(&pool, 2)), None);
        assert_eq!(pool.lookup(hashes[0], root, &full(&pool, 0)), Some(blocks[0]));
        assert_eq!(pool.block_hash(blocks[2]), None);
        pool.validate().unwrap();
    }

    #[test]
    fn hit_revives_a_free_cached_block_from_the_middle_of_the_list() {
        let mut pool = BlockPool::new(5, 2);
        let blocks: Vec<u32> = (0..4).map(|_| pool.allocate().unwrap()).collect();
        let root = root_hash(None, 0);
        let toks = full(&pool, 9);
        let h = hash_block(root, &toks);
        pool.register(blocks[1], h, root, &toks);
        for &b in &blocks {
            pool.free(b);
        }
        let hit = pool.lookup(h, root, &toks).unwrap();
        assert_eq!(hit, blocks[1]);
        pool.touch(hit);
        assert_eq!(pool.ref_count(hit), 1);
        assert_eq!(pool.num_free(), 3);
        assert_eq!(pool.num_cached_free(), 0);
        pool.validate().unwrap();
        let rest: Vec<u32> = std::iter::from_fn(|| pool.allocate()).collect();
        assert!(!rest.contains(&hit));
        assert_eq!(pool.block_hash(hit), Some(h), "an in-use block keeps its hash");
    }

    #[test]
    fn lookup_verifies_tokens_and_parent() {
        let mut pool = BlockPool::new(4, 2);
        let b = pool.allocate().unwrap();
        let root = root_hash(None, 0);
        let toks = vec![1, 2];
        let h = hash_block(root, &toks);
        pool.register(b, h, root, &toks);
        assert_eq!(pool.lookup(h, root, &[1, 2]), Some(b));
        // Same hash key but different content (a forced "collision") must miss.
        assert_eq!(pool.lookup(h, root, &[1, 3]), None);
        assert_eq!(pool.lookup(h, root_hash(Some("salt"), 0), &[1, 2]), None);
    }

    #[test]
    fn duplicate_hash_is_not_registered_twice() {
        let mut pool = BlockPool::new(4, 2);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        let root = root_hash(None, 0);
        let toks = vec![5, 5];
        let h = hash_block(root, &toks);
        assert!(pool.register(a, h, root, &toks));
        assert!(!pool.register(b, h, root, &toks));
        assert_eq!(pool.block_hash(b), None);
        pool.free(b);
        pool.free(a);
        assert_eq!(pool.num_cached_free(), 1);
        pool.validate().unwrap();
    }

    #[test]
    fn forget_turns_a_cached_block_plain() {
        let mut pool = BlockPool::new(4, 2);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        let root = root_hash(None, 0);
        let toks = vec![5, 6];
        let h = hash_block(root, &toks);
        pool.register(a, h, root, &toks);
        pool.free(a);
        pool.free(b);
        assert_eq!(pool.num_cached_free(), 1);
        pool.forget(a);
        assert_eq!(pool.num_cached_free(), 0);
        assert_eq!(pool.lookup(h, root, &toks), None);
        assert_eq!(pool.allocate(), Some(a), "a plain block is reused first");
        pool.validate().unwrap();
    }

    #[test]
    fn salt_and_parent_change_the_hash() {
        let t = [1u32, 2, 3, 4];
        assert_ne!(root_hash(None, 0), root_hash(Some(""), 0));
        assert_ne!(root_hash(Some("a"), 0), root_hash(Some("b"), 0));
        assert_ne!(root_hash(None, 0), root_hash(None, 1));
        assert_ne!(root_hash(Some("a"), 1), root_hash(Some("a"), 2));
        // (a salt's tail spelling an adapter index, as the bytes of a u32 on either end)
        for lora in [1u32, 7, 0x0100_0000] {
            for bytes in [lora.to_le_bytes(), lora.to_be_bytes()] {
                let tail = String::from_utf8(bytes.to_vec()).unwrap_or_default();
                assert_ne!(root_hash(Some("s"), lora), root_hash(Some(&format!("s{tail}")), 0));
                assert_ne!(root_hash(Some(&format!("s{tail}")), 0), root_hash(Some("s"), lora));
            }
        }
        assert_ne!(hash_block(root_hash(None, 0), &t), hash_block(root_hash(Some("a"), 0), &t));
        assert_eq!(hash_block(7, &t), hash_block(7, &t));
    }
}
