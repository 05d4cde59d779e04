//! B-trees: extent buffers (`extent_buffer`), the node cache of validated blocks (`node_cache`), search and iteration
//! over them (`search`), and changes under copy-on-write (`modify`).

pub mod extent_buffer;
pub mod modify;
pub mod node_cache;
pub mod search;
