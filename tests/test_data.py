"""Data sources, the fixed split, the one batch order, and the errors bad data gets."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms import data as D


def test_digits_split_and_normalisation():
    ds = D.load_digits()
    assert ds.x_train.shape[1:] == (8, 8, 1) and ds.x_train.dtype == np.float32
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert abs(float(ds.x_train.mean())) < 1e-5 and abs(float(ds.x_train.std()) - 1) < 1e-4
    assert ds.meta["normalisation"]["raw_max"] == 16.0
    assert ds.hash() == D.load_digits().hash()


def test_default_digits_follow_the_models_shape():
    """`--data digits` (the default) gives a 32x32x3 model the digits built at its shape, not an error."""
    ds = D.load_data("digits", image_shape=(32, 32, 3))
    assert ds.image_shape == (32, 32, 3) and ds.hash() == D.digits32().hash()
    assert D.load_data("digits", image_shape=(8, 8, 1)).image_shape == (8, 8, 1)
    with pytest.raises(D.DataError, match="expects"):
        D.check_fits(D.load_data("digits", image_shape=(16, 16, 1)), (16, 16, 1), 10, "m16")


def test_order_is_per_epoch_permutation():
    o = D.batch_order(100, 10, 25, seed=3)
    assert o.shape == (25, 10)
    assert sorted(o[:10].ravel()) == list(range(100))   # epoch 0 sees every sample once
    assert sorted(o[10:20].ravel()) == list(range(100))
    assert not np.array_equal(o[:10], o[10:20])
    assert np.array_equal(o, D.batch_order(100, 10, 25, seed=3))
    assert not np.array_equal(o, D.batch_order(100, 10, 25, seed=4))
    with pytest.raises(D.DataError, match="larger than the train set"):
        D.batch_order(5, 10, 1, 0)


def test_dropout_mask_is_deterministic_and_rate():
    m = D.dropout_keep_mask(0, 5, 3, (64, 64), 0.25)
    assert np.array_equal(m, D.dropout_keep_mask(0, 5, 3, (64, 64), 0.25))
    assert not np.array_equal(m, D.dropout_keep_mask(0, 6, 3, (64, 64), 0.25))
    assert 0.2 < 1 - m.mean() < 0.3


def _write(p, text):
    p.write_text(text)
    return p


def test_csv_loader_and_cache(tmp_path):
    rows = ["label," + ",".join(f"pixel{i}" for i in range(4))]
    rows += [f"{i % 3},{i},{2 * i},{3 * i},{255}" for i in range(20)]
    f = _write(tmp_path / "train.csv", "\n".join(rows) + "\n")
    ds = D.load_csv(f, cache_dir=tmp_path / "cache")
    assert ds.image_shape == (2, 2, 1) and len(ds.x_train) + len(ds.x_test) == 20
    assert len(list((tmp_path / "cache").glob("csv-*.npz"))) == 1
    ds2 = D.load_csv(f, cache_dir=tmp_path / "cache")       # from the cache, same numbers
    assert ds2.hash() == ds.hash()


@pytest.mark.parametrize("text,needle", [
    ("label,p0,p1,p2,p3\n1,0,0,x,0\n", "line 2, p2: 'x' is not a number"),
    ("label,p0,p1,p2\n1,0,0,0\n", "3 pixel columns are not a square image"),
    ("label,p0,p1,p2,p3\n1,0,0,0\n", "line 2 has 4 columns, expected 5"),
    ("", "the file is empty"),
    ("label,p0,p1,p2,p3\n", "header but no data rows"),
    ("label,p0,p1,p2,p3\n-1,0,0,0,0\n2,0,0,0,0\n3,0,0,0,0\n4,0,0,0,0\n5,0,0,0,0\n", "line 2, column 'label': label -1 is not a non-negative integer"),
    ("p0,p1,p2,p3,p4\n0.5,0,0,0,0\n2,0,0,0,0\n3,0,0,0,0\n4,0,0,0,0\n5,0,0,0,0\n",
     "line 2, column 'p0' (the header names no 'label' column: the first is taken): label 0.5 is not"),
    ("-1,0,0,0,0\n2,0,0,0,0\n", "line 1, column 1: label -1"),
    ("label;p0;p1;p2;p3\n1;0;0;0;0\n", "line 2 is separated by ';', not by commas"),
    ("label\tp0\tp1\tp2\tp3\n1\t0\t0\t0\t0\n", "line 2 is separated by '\\t', not by commas"),
])
def test_csv_errors_name_file_and_problem(tmp_path, text, needle):
    f = _write(tmp_path / "d.csv", text)
    with pytest.raises(D.DataError) as e:
        D.load_csv(f)
    assert str(f) in str(e.value) and needle in str(e.value)


def test_missing_and_bad_npz(tmp_path):
    with pytest.raises(D.DataError, match="no such data file"):
        D.load_data(str(tmp_path / "nope.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")     # numpy alone would call it a pickle
    with pytest.raises(D.DataError, match=r"not an \.npz file \(not a zip archive"):
        D.load_data(str(tmp_path / "junk.npz"))
    import zipfile
    with zipfile.ZipFile(tmp_path / "zip.npz", "w") as z:   # a zip, but no array in it
        for k in ("x_train", "y_train", "x_test", "y_test"):
            z.writestr(f"{k}.npy", "not an array")
    with pytest.raises(D.DataError, match="not a readable .npz"):
        D.load_data(str(tmp_path / "zip.npz"))
    np.savez(tmp_path / "w.npz", images=np.zeros((3, 2, 2)))
    with pytest.raises(D.DataError, match="needs arrays"):
        D.load_data(str(tmp_path / "w.npz"))
    np.savez(tmp_path / "s.npz", x=np.zeros((10, 2)), y=np.zeros(10))
    with pytest.raises(D.DataError, match=r"images must be \(N, H, W\)"):
        D.load_data(str(tmp_path / "s.npz"))


@pytest.mark.parametrize("arrays, needle", [
    ({"y": np.arange(20).astype(str)}, "array y has dtype <U21; labels must be integers"),
    ({"y": (np.arange(20) % 10).astype(np.complex64)}, "array y has dtype complex64"),
    ({"x": np.float32(1.0)}, "array x is a scalar, not one entry per sample"),
    # int32 would wrap 2**40 + 3 onto class 3: the data would be changed without a word
    ({"y": np.arange(20) % 10 + 2**40}, "label 1099511627785 in the train set is beyond int32"),
    # the split indexed the labels by the images' permutation: more labels than images were cut without a word
    ({"y": np.arange(40) % 10}, "x holds 20 images but y holds 40 labels"),
    ({"y": np.arange(10) % 10}, "x holds 20 images but y holds 10 labels"),
    ({"y": np.zeros((20, 10))}, "array y has shape (20, 10); labels must be one integer per image, shape (N,)"),
    ({"x": np.zeros(20)}, "array x has shape (20,); images must be (N, H, W)"),
    ({"x": np.zeros((1, 8, 8)), "y": np.zeros(1)}, "array x holds 1 images, too few to train and test on"),
])
def test_npz_arrays_of_the_wrong_kind_are_one_line(tmp_path, arrays, needle):
    """As a user's file may hold them: each was a traceback (strings, complex, a scalar) or, for labels beyond
    int32, silently wrapped onto valid classes."""
    base = {"x": np.random.default_rng(0).uniform(0, 1, (20, 8, 8)), "y": np.arange(20) % 10}
    f = tmp_path / "d.npz"
    np.savez(f, **{**base, **arrays})
    with pytest.raises(D.DataError) as e:
        D.load_data(str(f))
    assert str(f) in str(e.value) and needle in str(e.value)


def test_npz_and_fit_check(tmp_path):
    x = np.random.default_rng(0).uniform(0, 1, (50, 8, 8))
    y = np.arange(50) % 10
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    ds = D.load_data(str(tmp_path / "ok.npz"))
    D.check_fits(ds, (8, 8, 1), 10, "m")
    with pytest.raises(D.DataError, match="expects"):
        D.check_fits(ds, (28, 28, 1), 10, "m")
    with pytest.raises(D.DataError, match="out of range"):
        D.check_fits(ds, (8, 8, 1), 5, "m")


def test_synthetic_is_seeded():
    a, b = D.synthetic(200), D.synthetic(200)
    assert a.hash() == b.hash() and a.image_shape == (8, 8, 1)


def test_npz_bool_arrays_and_column_labels_load(tmp_path):
    """Binarized images (bool), bool labels (two classes) and (N, 1) labels as Keras' own data sets give them."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.random((20, 8, 8)) > 0.5, y=(np.arange(20) % 2 == 0)[:, None])
    ds = D.load_data(str(tmp_path / "d.npz"))
    assert ds.image_shape == (8, 8, 1) and sorted(set(ds.y_train) | set(ds.y_test)) == [0, 1]


def test_a_csv_whose_every_column_is_a_pixel_says_the_label_column_is_missing(tmp_path):
    """A header of 64 pixel names and no 'label' on an 8x8 model: said as a missing label, not '63 pixel columns'."""
    rows = "\n".join(",".join(["3"] * 64) for _ in range(6))
    f = _write(tmp_path / "pixels.csv", ",".join(f"p{i}" for i in range(64)) + "\n" + rows + "\n")
    with pytest.raises(D.DataError) as e:
        D.load_csv(f, image_shape=(8, 8, 1))
    assert str(e.value) == (f"{f}: no label column: the header names no 'label' and its 64 columns are the image's 64 "
                            f"pixels [8, 8, 1]; put the label first (or in a column named 'label')")
