use ubtrfs_core::*;
use ubtrfs_format::Key;
fn main() {
    let p = std::env::args().nth(1).unwrap();
    let fs = FsInfo::open(&OpenOptions::new(p)).unwrap();
    for w in fs.take_warnings() {
        eprintln!("warn: {w}");
    }
    for id in [1u64, 2, 3, 4, 5, 7, 10] {
        let root = if id == 1 { fs.tree_root() } else { fs.read_root(id).unwrap().0 };
        let n = fs.iter(&root, Key::MIN).unwrap().count();
        println!("tree {id}: {n} items root {:?}", root);
    }
}
