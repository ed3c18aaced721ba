//! Result files are replaced atomically: complete new contents or the old file.
use memsave_bench::write_atomic;

#[test]
fn replaces_the_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.json");
    std::fs::write(&path, "x".repeat(10_000)).unwrap();
    write_atomic(&path, "{}\n").unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "{}\n");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_failed_write_leaves_the_old_file_and_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    // The target is a directory: the rename fails after the temporary was written.
    let target = dir.path().join("taken");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("keep"), "good").unwrap();
    assert!(write_atomic(&target, "new").is_err());
    assert_eq!(
        std::fs::read_to_string(target.join("keep")).unwrap(),
        "good"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    // A missing directory fails before anything is written.
    assert!(write_atomic(dir.path().join("no/such/dir.json"), "x").is_err());
}
