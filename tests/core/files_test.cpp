// hp::files::remove_tree against a tree made here: everything below the path goes, a
// symbolic link inside is removed without following it (its target survives), a missing
// path is fine, and a path that cannot be removed is named.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "hp/core/files.h"

namespace {
bool present(const std::string& p) {
  struct stat st{};
  return ::lstat(p.c_str(), &st) == 0;
}
}  // namespace

TEST(Files, RemoveTreeRemovesEverythingBelowAndFollowsNoLink) {
  const std::string root = ::testing::TempDir() + "hp_files_tree", keep = ::testing::TempDir() + "hp_files_keep";
  hp::files::remove_tree(root);
  hp::files::remove_tree(keep);
  ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a/b").c_str(), 0755), 0);
  std::ofstream(root + "/a/b/f.txt") << "x";
  std::ofstream(root + "/g.txt") << "y";
  ASSERT_EQ(::mkdir(keep.c_str(), 0755), 0);
  std::ofstream(keep + "/precious.txt") << "z";
  ASSERT_EQ(::symlink(keep.c_str(), (root + "/a/link").c_str()), 0);
  EXPECT_EQ(hp::files::remove_tree(root), "");
  EXPECT_FALSE(present(root));
  EXPECT_TRUE(present(keep + "/precious.txt")) << "followed a symbolic link";
  EXPECT_EQ(hp::files::remove_tree(root), "") << "a missing path is not an error";
  std::ofstream(root) << "a file";
  EXPECT_EQ(hp::files::remove_tree(root), "");
  EXPECT_FALSE(present(root));
  hp::files::remove_tree(keep);
  if (::geteuid() != 0) {  // root may remove anything: the failure case needs a plain user
    ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
    ASSERT_EQ(::mkdir((root + "/locked").c_str(), 0755), 0);
    std::ofstream(root + "/locked/f") << "x";
    ::chmod((root + "/locked").c_str(), 0555);
    const std::string error = hp::files::remove_tree(root);
    EXPECT_NE(error.find("cannot remove '" + root + "/locked/f'"), std::string::npos) << error;
    ::chmod((root + "/locked").c_str(), 0755);
    hp::files::remove_tree(root);
  }
}

// create_folders: every missing part made, an existing folder fine, a file in the way named.
TEST(Files, CreateFoldersMakesEveryPartAndNamesAFileInTheWay) {
  const std::string root = ::testing::TempDir() + "hp_files_create";
  hp::files::remove_tree(root);
  EXPECT_EQ(hp::files::create_folders(root + "/a/b//c/"), "");
  struct stat st{};
  ASSERT_EQ(::stat((root + "/a/b/c").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(hp::files::create_folders(root + "/a/b"), "") << "an existing folder is not an error";
  std::ofstream(root + "/file") << "x";
  std::string error = hp::files::create_folders(root + "/file/sub");
  EXPECT_EQ(error, "cannot create '" + root + "/file/sub': '" + root + "/file' is not a folder");
  error = hp::files::create_folders(root + "/file");
  EXPECT_EQ(error, "cannot create '" + root + "/file': '" + root + "/file' is not a folder");
  EXPECT_NE(hp::files::create_folders(""), "");
  std::ifstream f(root + "/file");
  std::string text;
  f >> text;
  EXPECT_EQ(text, "x") << "the file in the way was changed";
  hp::files::remove_tree(root);
}
